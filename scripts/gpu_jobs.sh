#!/usr/bin/env bash
# The H200 session's GPU work, one job per 10-minute device call. Each step runs under its own time limit, skips
# itself when the call's deadline is too near, logs to $OUT/<step>.log and leaves its JSON under $OUT.
#   bash scripts/gpu_jobs.sh ckpt-sft   # issue 4's frontier table, issue 5's sft.py speed check
#   bash scripts/gpu_jobs.sh tests      # pytest -m gpu tests/gpu, then the Llama-1B benchmark and a profile
#   bash scripts/gpu_jobs.sh bench      # GPT-NeoX 1.4B and Llama-8B LoRA benchmarks
#   bash scripts/gpu_jobs.sh final      # the re-runs after this session's fixes
#   bash scripts/gpu_jobs.sh last       # Llama-1B budget-mode re-run, sft.py's three runs
#   bash scripts/gpu_jobs.sh compile-check  # compiled layers' GPU tests, profile, GPT-NeoX same-run bench
#   bash scripts/gpu_jobs.sh compile-1b     # compiled Llama-1B: kernel gaps, same-run bench; fused-op GPU tests
#   bash scripts/gpu_jobs.sh compile-8b     # compiled Llama-8B LoRA with a budget plan vs TRL, same run
#   bash scripts/gpu_jobs.sh compile-final  # final same-run Llama-1B and Falcon benches, last GPU tests
#   bash scripts/gpu_jobs.sh gc-check       # Llama-1B re-run with the GC freeze; NeoX op-level fused-ops test
#   bash scripts/gpu_jobs.sh ce             # inline fused CE: LM-head micro-benchmark, GPU test, Llama-1B, profile
#   bash scripts/gpu_jobs.sh events         # event-timed loops: Llama-1B, NeoX, Falcon same-run benches
#   bash scripts/gpu_jobs.sh bf16-acc       # inline CE with weight-dtype accumulation: GPU test, Llama-1B, NeoX
#   bash scripts/gpu_jobs.sh next           # new GPU tests, NeoX with slow-step attribution, Llama-8B LoRA
#   bash scripts/gpu_jobs.sh profiles       # profiles of NeoX, Falcon, Llama-8B LoRA; LM-head micro-bench
#   bash scripts/gpu_jobs.sh nosync         # no-sync / LoRA-cast / compiled+op fused-ops tests, Llama-8B and -1B
#   bash scripts/gpu_jobs.sh nosync-2       # Llama-8B LoRA profile after the cast skip; NeoX and Falcon same-run
#   bash scripts/gpu_jobs.sh gpu-all        # every GPU test (pytest -m gpu tests/gpu), one call
#   bash scripts/gpu_jobs.sh after-6        # next session: the GPU tests gpu-all did not reach, Falcon with the
#                                           # collator's metadata, Llama-1B under a 23 GiB checkpointing budget
#   bash scripts/gpu_jobs.sh compile    # Llama-1B: patch(compile=True) vs eager hf_accel-best vs TRL+FA4+Liger
# (after ../shared/gpu/fetch-gpu-wheels.sh's two set-up calls; see BENCHMARKS.md for what each produced)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${JOB_SECONDS:-560}))
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    if ((SECONDS + limit > DEADLINE)); then
        echo "SKIP $name (needs ${limit}s, $((DEADLINE - SECONDS))s left)" | tee -a "$OUT/summary.txt"
        return
    fi
    local start=$SECONDS
    timeout --signal=INT --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.log"
}

sft() {  # sft NAME FLAGS...: scripts/sft.py on Llama-1B shapes, metrics.json copied to $OUT/NAME.json
    local name=$1
    shift
    step "$name" 110 python scripts/sft.py --model-shape llama-1b --max-steps 60 --logging-steps 10 \
        --eval-examples 0 --output-dir "/tmp/$name" "$@"
    cp "/tmp/$name/metrics.json" "$OUT/$name.json" 2>/dev/null
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$OUT/gpu.txt"

case "${1:?job: ckpt-sft | tests | bench | final | last | compile | compile-check | compile-1b | compile-8b | compile-final | gc-check | ce | events | bf16-acc | next | profiles | nosync | nosync-2 | gpu-all | after-6}" in
ckpt-sft)
    step ckpt 260 python scripts/bench_checkpointing.py --out "$OUT/bench_checkpointing.json"
    sft sft_patched --max-tokens-per-batch 16384 --fused-ce --fused-ops
    sft sft_nopatch_packed --max-tokens-per-batch 16384 --no-patch
    sft sft_stock_padded --no-patch --no-packing --batch-size 8
    python scripts/sft_speed_table.py "$OUT"/sft_*.json | tee "$OUT/sft_table.md"
    ;;
tests)
    step gpu_tests 250 python -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider
    step bench_llama1b 240 python scripts/bench.py --workload llama-1b --out "$OUT" \
        --configs trl-fa4-packed-liger,hf_accel,hf_accel-best --steps 25 --warmup 5 --time-budget 225 \
        --config-timeout 75
    step profile 50 python scripts/profile_step.py --workload llama-1b --fused-ce auto --fused-ops \
        --out "$OUT/profile_llama-1b.json"
    ;;
bench)
    step bench_neox 230 python scripts/bench.py --workload neox-1.4b --out "$OUT" \
        --configs trl-fa4-packed,hf_accel,hf_accel-best --steps 20 --warmup 4 --time-budget 215 --config-timeout 75
    step bench_llama8b 300 python scripts/bench.py --workload llama-8b-lora --out "$OUT" \
        --configs trl-fa4-packed,hf_accel-best,hf_accel --best-checkpointing budget:0.8 --steps 8 --warmup 2 \
        --time-budget 285 --config-timeout 120
    ;;
final)  # re-runs after the fixes of the session's first runs (probe leak, many-document fa4 calls)
    step ckpt 230 python scripts/bench_checkpointing.py --out "$OUT/bench_checkpointing.json"
    step gpu_tests 130 python -m pytest -m gpu -q -rA -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
        tests/gpu/test_models_gpu.py -k "short or window or falcon"
    sft sft_patched --max-tokens-per-batch 16384 --fused-ce --fused-ops
    step bench_llama8b_budget 150 python scripts/bench.py --workload llama-8b-lora --out "$OUT" \
        --configs hf_accel-best --best-checkpointing budget:0.8 --steps 8 --warmup 2 --time-budget 140 \
        --config-timeout 130
    ;;
last)  # the budget mode's headroom on Llama-1B, and sft.py's three runs in one call (same-run baselines)
    step ckpt 90 python scripts/bench_checkpointing.py --workloads llama-1b-full --out "$OUT/bench_checkpointing_1b.json"
    sft sft_patched --max-tokens-per-batch 16384 --fused-ce --fused-ops
    sft sft_nopatch_packed --max-tokens-per-batch 16384 --no-patch
    sft sft_stock_padded --no-patch --no-packing --batch-size 8
    python scripts/sft_speed_table.py "$OUT"/sft_*.json | tee "$OUT/sft_table.md"
    ;;
compile)  # patch(compile=True) against the same settings eager and TRL + FA4 + Liger, Llama-1B shapes
    step bench_llama1b_compiled 200 python scripts/bench.py --workload llama-1b --out "$OUT" \
        --configs hf_accel-best --best-compile on --steps 25 --warmup 5 --time-budget 190 --config-timeout 190
    step bench_llama1b 230 python scripts/bench.py --workload llama-1b --out "$OUT" \
        --configs trl-fa4-packed-liger,hf_accel-best --steps 25 --warmup 5 --time-budget 220 --config-timeout 100
    ;;
compile-check)  # compiled layers' GPU tests (+ fused ops x op-level), a compiled profile, GPT-NeoX same-run bench
    step gpu_tests 230 python -m pytest -m gpu -q -rA -p no:cacheprovider tests/gpu/test_compile_gpu.py \
        tests/gpu/test_fused_ops_gpu.py -k op
    step profile 70 python scripts/profile_step.py --workload llama-1b --fused-ce auto --fused-ops --compile \
        --out "$OUT"
    step bench_neox 230 python scripts/bench.py --workload neox-1.4b --out "$OUT" --best-compile on \
        --configs trl-fa4-packed,hf_accel-best --steps 20 --warmup 5 --time-budget 215 --config-timeout 120
    ;;
compile-1b)  # where the compiled step still waits (kernel gaps, recompiles), Llama-1B same-run bench, fused-op tests
    step profile 80 env TORCH_LOGS=recompiles python scripts/profile_step.py --workload llama-1b --fused-ce auto \
        --fused-ops --compile --out "$OUT"
    grep -c "Recompiling function" "$OUT/profile.log"
    step bench_llama1b 250 python scripts/bench.py --workload llama-1b --out "$OUT" --best-compile on \
        --configs trl-fa4-packed-liger,hf_accel,hf_accel-best --steps 25 --warmup 6 --time-budget 240 \
        --config-timeout 110
    step gpu_tests 120 python -m pytest -m gpu -q -rA -p no:cacheprovider tests/gpu/test_fused_ops_gpu.py -k op
    ;;
compile-8b)  # Llama-8B LoRA + checkpointing, same run: TRL + FA4 against compiled hf_accel-best with a budget plan
    step bench_llama8b 330 python scripts/bench.py --workload llama-8b-lora --out "$OUT" --best-compile on \
        --configs trl-fa4-packed,hf_accel-best --best-checkpointing budget:0.8 --steps 8 --warmup 3 \
        --time-budget 320 --config-timeout 165
    ;;
compile-final)  # after moving the compile break to the registry function: GPU tests, Llama-1B and Falcon same-run
    step gpu_tests 130 python -m pytest -m gpu -q -rA -p no:cacheprovider \
        "tests/gpu/test_compile_gpu.py::test_compiled_train_steps_match_eager[llama-1b]" \
        "tests/gpu/test_fused_ops_gpu.py::test_fused_ops_train_step[neox-1.4b-op]"
    step bench_llama1b 210 python scripts/bench.py --workload llama-1b --out "$OUT" --best-compile on \
        --configs trl-fa4-packed-liger,hf_accel-best --steps 25 --warmup 6 --time-budget 200 --config-timeout 100
    step bench_falcon 170 python scripts/bench.py --workload falcon-1b --out "$OUT" --best-compile on \
        --configs hf-sdpa-padded,hf_accel-best --steps 15 --warmup 6 --time-budget 160 --config-timeout 80
    ;;
gc-check)  # next session: Llama-1B same-run with the garbage-collector freeze, the unfinished NeoX op-level test
    step bench_llama1b 210 python scripts/bench.py --workload llama-1b --out "$OUT" --best-compile on \
        --configs trl-fa4-packed-liger,hf_accel-best --steps 25 --warmup 6 --time-budget 200 --config-timeout 100
    step gpu_tests 200 python -m pytest -m gpu -q -rA -p no:cacheprovider \
        "tests/gpu/test_fused_ops_gpu.py::test_fused_ops_train_step[neox-1.4b-op]"
    step profile 80 python scripts/profile_step.py --workload llama-1b --fused-ce auto --fused-ops --compile \
        --out "$OUT"
    ;;
ce)  # the inline fused CE: LM-head micro-benchmark, its GPU test, Llama-1B same-run and a compiled profile
    step lm_head 120 python scripts/bench_lm_head.py --out "$OUT/lm_head.json"
    step gpu_tests 150 python -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/gpu/test_fused_ce_gpu.py
    step bench_llama1b 210 python scripts/bench.py --workload llama-1b --out "$OUT" --best-compile on \
        --configs trl-fa4-packed-liger,hf_accel-best --steps 25 --warmup 6 --time-budget 200 --config-timeout 100
    step profile 80 python scripts/profile_step.py --workload llama-1b --fused-ce auto --fused-ops --compile \
        --out "$OUT"
    ;;
events)  # after the inline CE and the event-timed loops: Llama-1B, NeoX and Falcon same-run benches
    step bench_llama1b 170 python scripts/bench.py --workload llama-1b --out "$OUT" --best-compile on \
        --configs trl-fa4-packed-liger,hf_accel-best --steps 30 --warmup 6 --time-budget 160 --config-timeout 80
    step bench_neox 160 python scripts/bench.py --workload neox-1.4b --out "$OUT" --best-compile on \
        --configs trl-fa4-packed,hf_accel-best --steps 20 --warmup 6 --time-budget 150 --config-timeout 75
    step bench_falcon 160 python scripts/bench.py --workload falcon-1b --out "$OUT" --best-compile on \
        --configs hf-sdpa-padded,hf_accel-best --steps 15 --warmup 6 --time-budget 150 --config-timeout 75
    ;;
bf16-acc)  # the inline CE accumulating the weight gradient in the weight's dtype: GPU test, Llama-1B peak and speed
    step gpu_tests 60 python -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/gpu/test_fused_ce_gpu.py
    step bench_llama1b 130 python scripts/bench.py --workload llama-1b --out "$OUT" --best-compile on \
        --configs trl-fa4-packed-liger,hf_accel-best --steps 30 --warmup 6 --time-budget 125 --config-timeout 62
    TORCH_LOGS=recompiles step bench_neox 100 python scripts/bench.py --workload neox-1.4b --out "$OUT" \
        --best-compile on --configs hf_accel-best --steps 20 --warmup 6 --time-budget 95 --config-timeout 95
    grep -h "Recompiling\|triggered by" "$OUT"/bench_neox.log 2>/dev/null | head -20
    ;;
next)  # next session: the unrun GPU tests, NeoX with host-event attribution of slow steps, Llama-8B LoRA (inline CE)
    step gpu_tests 90 python -m pytest -m gpu -q -rA -p no:cacheprovider tests/gpu/test_fused_ce_gpu.py \
        tests/gpu/test_no_sync_gpu.py
    step bench_neox 170 python scripts/bench.py --workload neox-1.4b --out "$OUT" --best-compile on \
        --configs trl-fa4-packed,hf_accel-best --steps 30 --warmup 6 --time-budget 160 --config-timeout 80
    step bench_llama8b 290 python scripts/bench.py --workload llama-8b-lora --out "$OUT" --best-compile on \
        --configs trl-fa4-packed,hf_accel-best --best-checkpointing budget:0.8 --steps 8 --warmup 3 \
        --time-budget 280 --config-timeout 140
    ;;
profiles)  # issue 7's per-workload profiles of the benchmarked hf_accel-best configurations
    step profile_neox 120 python scripts/profile_step.py --workload neox-1.4b --fused-ce auto --fused-ops --compile \
        --warmup 6 --out "$OUT"
    step profile_falcon 120 python scripts/profile_step.py --workload falcon-1b --fused-ce auto --fused-ops --compile \
        --warmup 6 --out "$OUT"
    step lm_head 60 python scripts/bench_lm_head.py --out "$OUT/lm_head.json"
    step profile_llama8b 240 python scripts/profile_step.py --workload llama-8b-lora --fused-ce auto --fused-ops \
        --compile --checkpointing budget:0.8 --warmup 3 --steps 4 --profile-steps 2 --out "$OUT"
    ;;
nosync)  # after skipping transformers' packed search and PEFT's autocast round trip, liger in eager compiled layers
    step gpu_tests 120 python -m pytest -m gpu -q -rA -p no:cacheprovider tests/gpu/test_no_sync_gpu.py \
        tests/gpu/test_lora_casts_gpu.py \
        tests/gpu/test_fused_ops_gpu.py::test_fused_ops_with_compiled_layers_and_op_checkpointing
    step bench_llama8b 210 python scripts/bench.py --workload llama-8b-lora --out "$OUT" --best-compile on \
        --configs trl-fa4-packed,hf_accel-best --best-checkpointing budget:0.8 --steps 8 --warmup 3 \
        --time-budget 200 --config-timeout 100
    step bench_llama1b 170 python scripts/bench.py --workload llama-1b --out "$OUT" --best-compile on \
        --configs trl-fa4-packed-liger,hf_accel-best --steps 30 --warmup 6 --time-budget 160 --config-timeout 80
    ;;
nosync-2)
    step profile_llama8b 120 python scripts/profile_step.py --workload llama-8b-lora --fused-ce auto --fused-ops \
        --compile --checkpointing budget:0.8 --warmup 3 --steps 4 --profile-steps 2 --out "$OUT"
    step bench_neox 160 python scripts/bench.py --workload neox-1.4b --out "$OUT" --best-compile on \
        --configs trl-fa4-packed,hf_accel-best --steps 30 --warmup 6 --time-budget 150 --config-timeout 75
    step bench_falcon 150 python scripts/bench.py --workload falcon-1b --out "$OUT" --best-compile on \
        --configs hf-sdpa-padded,hf_accel-best --steps 15 --warmup 6 --time-budget 140 --config-timeout 70
    ;;
gpu-all)
    # most affected by the latest changes first; a cut run still prints pytest's summary of what ran (SIGINT)
    step gpu_tests "$(( ${JOB_SECONDS:-560} - 20 ))" python -m pytest -m gpu -q -rA -p no:cacheprovider \
        tests/gpu/test_compile_gpu.py tests/gpu/test_models_gpu.py tests/gpu/test_fused_ops_gpu.py \
        tests/gpu/test_kernels_gpu.py tests/gpu/test_no_sync_gpu.py tests/gpu/test_lora_casts_gpu.py \
        tests/gpu/test_fused_ce_gpu.py tests/gpu/test_flash_mha_gpu.py
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu_tests.log" | tail -80
    ;;
after-6)
    step gpu_tests 200 python -m pytest -m gpu -q -rA -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
        tests/gpu/test_flash_mha_gpu.py "tests/gpu/test_fused_ops_gpu.py::test_fused_ops_train_step[neox-1.4b-None]"
    step bench_falcon 150 python scripts/bench.py --workload falcon-1b --out "$OUT" --best-compile on \
        --configs hf-sdpa-padded,hf_accel-best --steps 15 --warmup 6 --time-budget 140 --config-timeout 70
    step bench_llama1b 190 python scripts/bench.py --workload llama-1b --out "$OUT" --best-compile on \
        --best-checkpointing budget:23GiB --configs trl-fa4-packed-liger,hf_accel-best --steps 30 --warmup 6 \
        --time-budget 180 --config-timeout 90
    ;;
*)
    echo "unknown job $1" >&2
    exit 2
    ;;
esac
echo "== summary"
cat "$OUT/summary.txt"
