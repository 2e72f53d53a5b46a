#!/usr/bin/env bash
# The H200 check: the GPU tests and the standard bench, in phases that each fit one 10-minute device call.
#
#   bash scripts/gpu_check.sh tests [FILE ...]    # pytest -m gpu: each tests/gpu file in its own process (default all)
#   bash scripts/gpu_check.sh bench [PRESET ...]  # scripts/bench.py presets, one process per config (default llama-1b)
#   bash scripts/gpu_check.sh all                 # tests, then bench llama-1b (no per-call limit: ~12 min)
#   bash scripts/gpu_check.sh suite [ARGS ...]    # `pytest -m gpu tests/gpu` in ONE process (issue 18e: no test may
#                                                 # depend on memory earlier tests released), the 30 slowest listed;
#                                                 # ARGS go to pytest (e.g. --ignore=tests/gpu/test_multi_gpu.py)
#   bash scripts/gpu_check.sh pair "tests FILE ..." "bench PRESET ..."
#                                                 # 2-GPU machine: the two phases side by side, one GPU each
#                                                 # (the machine's device time buys twice the single-GPU work)
#
# Presets: `python scripts/bench.py --list-presets` (llama-1b ~3 min, neox-1.4b ~3, falcon-1b ~3, falcon-rw-1b ~7,
# llama-8b-lora ~7 (six configurations); two short ones fit one call: `gpu_check.sh bench neox-1.4b falcon-1b`). Each test file runs in its own process because
# one process holding every test's models ran out of memory (issue 18). The multi-GPU presets (multi-gpu ~7-9 min,
# multi-gpu-8b-lora ~5.5, multi-gpu-8b ~3; one per call) need 2 GPUs (device kind nvidia-h200-x2): bench.py --nproc.
#
# Set-up (the GPU image lacks flash-attn-4, liger-kernel, trl, datasets): `bash ../shared/gpu/fetch-gpu-wheels.sh` on
# the CPU machine, then on the H200, back to back: call 1 (carrying .gpu/a) `bash .gpu/a/stage.sh`; call 2 (carrying
# .gpu/b) `source .gpu/b/activate.sh && bash scripts/gpu_check.sh tests`. Later calls while the machine is warm need
# nothing more: this script sources /tmp/gpu-env.sh (written by activate.sh) when those packages are not importable.
# Unsloth / bitsandbytes rows: `python scripts/pack_apart.py` here and, between calls 1 and 2, a call carrying
# .gpu/apart: `source .gpu/apart/install.sh` (into /tmp/site-unsloth and /tmp/site-bnb; with .gpu/b it is over 64 MiB).
#
# Output, under $OUT when set (the folder that comes back from the device machine), else under the checkout:
#   benchmarks/results/<workload>_<UTC stamp>.json|.md    bench records: copy them into the repo's benchmarks/results/
#                                                         and run `python scripts/bench_tables.py` (index, tables)
#   benchmarks/results/gpu_check_<UTC stamp>/             one log per test file / preset, junit XML, summary.md
# Time: the phase stops starting work JOB_SECONDS (default 570) after it began; what did not fit is listed in the
# summary with the command that runs it.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:-}
shift || true
case "$phase" in
tests | bench | all | suite) ;;
pair)
    # each half in its own process on its own GPU, its results under $OUT/gpu0 and $OUT/gpu1 (or ./gpu0, ./gpu1)
    [ $# -eq 2 ] || { echo 'usage: bash scripts/gpu_check.sh pair "tests [FILE ...]" "bench [PRESET ...]"' >&2; exit 2; }
    base=${OUT:-.}
    i=0
    for half in "$1" "$2"; do
        # shellcheck disable=SC2086
        CUDA_VISIBLE_DEVICES=$i OUT="$base/gpu$i" bash "$0" $half >"$base/gpu$i.log" 2>&1 &
        i=$((i + 1))
    done
    wait
    cat "$base/gpu0.log" "$base/gpu1.log"
    exit 0
    ;;
*)
    echo "usage: bash scripts/gpu_check.sh tests [FILE ...] | bench [PRESET ...] | all | suite [ARGS ...] | pair HALF HALF" >&2
    exit 2
    ;;
esac

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
stock_ok() { python -c "import flash_attn.cute, liger_kernel, trl, datasets" 2>/dev/null; }
if ! stock_ok && [ -f /tmp/gpu-env.sh ]; then
    # shellcheck disable=SC1091
    source /tmp/gpu-env.sh
    export PYTHONPATH="$PWD:$PYTHONPATH"
fi

base=${OUT:-.}
results="$base/benchmarks/results"
stamp=$(date -u +%Y-%m-%dT%H%M%S)
logs="$results/gpu_check_$stamp"
mkdir -p "$logs"
summary="$logs/summary.md"
default_seconds=570
[ "$phase" = all ] && default_seconds=780
deadline=$((SECONDS + ${JOB_SECONDS:-$default_seconds}))
left() { echo $((deadline - SECONDS)); }

{
    echo "# gpu_check.sh $phase $* ($stamp UTC)"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    stock_ok && echo "flash-attn-4, liger-kernel, trl, datasets: importable" ||
        echo "WARNING: flash-attn-4 / liger-kernel / trl / datasets missing: stock anchors and fa4 tests will skip" \
            "(set-up: this script's header)"
    echo '```'
} | tee "$summary"

run_tests() {  # run_tests [FILE ...]: each file in its own pytest process, under a per-file limit
    local files=("$@") file name limit start rc last skipped=()
    [ ${#files[@]} -eq 0 ] && files=(tests/gpu/test_*.py)
    printf '\n## GPU tests (`python -m pytest -m gpu FILE`, one process per file)\n\n' >>"$summary"
    echo "| file | exit | seconds | result |" >>"$summary"
    echo "|---|---:|---:|---|" >>"$summary"
    for file in "${files[@]}"; do
        name=$(basename "$file" .py)
        limit=$(left)
        ((limit > ${FILE_SECONDS:-330})) && limit=${FILE_SECONDS:-330}
        if ((limit < 45)); then
            skipped+=("$file")
            continue
        fi
        start=$SECONDS
        # SIGINT first: a cut run still prints pytest's summary of what ran
        timeout --signal=INT --kill-after=15 "$limit" python -m pytest -m gpu -q -rfEsP -p no:cacheprovider \
            --junitxml="$logs/$name.xml" "$file" >"$logs/$name.log" 2>&1
        rc=$?
        last=$(grep -E "(passed|failed|error|skipped|no tests ran)" "$logs/$name.log" | tail -n 1 | tr -d '=|')
        ((rc == 124)) && last="cut at ${limit}s: ${last}"
        echo "| $file | $rc | $((SECONDS - start)) | ${last:-see $name.log} |" | tee -a "$summary"
        grep -E "^(FAILED|ERROR) " "$logs/$name.log" | head -n 20 | sed 's/^/    /' | tee -a "$summary"
    done
    if [ ${#skipped[@]} -gt 0 ]; then
        echo | tee -a "$summary"
        echo "Not started (time): \`bash scripts/gpu_check.sh tests ${skipped[*]}\`" | tee -a "$summary"
    fi
}

run_bench() {  # run_bench [PRESET ...]: scripts/bench.py --preset P, its time budget cut to what the call has left
    local presets=("$@") preset limit budget start rc args extra skipped=()
    [ ${#presets[@]} -eq 0 ] && presets=(llama-1b)
    for preset in "${presets[@]}"; do
        limit=$(left)
        if ((limit < 120)); then
            skipped+=("$preset")
            continue
        fi
        printf '\n## bench preset %s\n\n' "$preset" >>"$summary"
        start=$SECONDS
        # bench.py stops starting configs at its --time-budget and still writes its JSON; the timeout is the backstop
        # (the preset's own budget, read in scripts/ where the harness package benchlib lives)
        # BENCH_ARGS: extra bench.py flags, e.g. "--device cpu --tiny --substitute-attn sdpa" for a CPU smoke run; a
        # --time-budget among them replaces the preset's, and either is cut to what the call has left: given once,
        # since the last of two would win and could outlast the timeout (run 36's records named both)
        args=" ${BENCH_ARGS:-} " extra=()
        if [[ $args =~ ^(.*)[[:space:]]--time-budget[[:space:]=]+([0-9]+)[.0-9]*[[:space:]](.*)$ ]]; then
            budget=${BASH_REMATCH[2]} args="${BASH_REMATCH[1]} ${BASH_REMATCH[3]}" extra=(--time-budget "$budget")
        else
            budget=$(cd scripts && python -c "from benchlib.presets import PRESETS as P; print(P['$preset'].settings.get(
                'time_budget', 540))" 2>/dev/null || echo 540)
        fi
        ((limit - 40 < budget)) && extra=(--time-budget "$((limit - 40))")
        # shellcheck disable=SC2086
        timeout --signal=INT --kill-after=15 "$((limit - 5))" python scripts/bench.py --preset "$preset" \
            --out "$results" "${extra[@]}" $args >"$logs/bench_$preset.log" 2>&1
        rc=$?
        echo "exit $rc after $((SECONDS - start)) s; $(grep -h '^\[bench\] wrote' "$logs/bench_$preset.log")" |
            tee -a "$summary"
        # the table bench.py prints last (from its "## workload" heading on)
        sed -n '/^## /,$p' "$logs/bench_$preset.log" | tail -n +2 | tee -a "$summary"
        ((rc != 0)) && tail -n 30 "$logs/bench_$preset.log" | sed 's/^/    /' | tee -a "$summary"
    done
    if [ ${#skipped[@]} -gt 0 ]; then
        echo | tee -a "$summary"
        echo "Not started (time): \`bash scripts/gpu_check.sh bench ${skipped[*]}\`" | tee -a "$summary"
    fi
}

run_suite() {  # run_suite [PYTEST ARGS ...]: the whole GPU suite in one pytest process
    local start=$SECONDS rc last
    printf '\n## GPU suite in one process (`python -m pytest -m gpu tests/gpu %s`)\n\n' "$*" >>"$summary"
    timeout --signal=INT --kill-after=15 "$(left)" python -m pytest -m gpu -q -rfEsP -p no:cacheprovider \
        --durations=30 --junitxml="$logs/suite.xml" tests/gpu "$@" >"$logs/suite.log" 2>&1
    rc=$?
    last=$(grep -E "(passed|failed|error|skipped|no tests ran)" "$logs/suite.log" | tail -n 1 | tr -d '=|')
    ((rc == 124)) && last="cut at $((SECONDS - start))s: ${last}"
    echo "exit $rc after $((SECONDS - start)) s: ${last:-see suite.log}" | tee -a "$summary"
    grep -E "^(FAILED|ERROR) " "$logs/suite.log" | head -n 20 | sed 's/^/    /' | tee -a "$summary"
    sed -n '/slowest .*durations/,/^$/p' "$logs/suite.log" | head -n 32 | sed 's/^/    /' | tee -a "$summary"
}

case "$phase" in
tests) run_tests "$@" ;;
suite) run_suite "$@" ;;
bench) run_bench "$@" ;;
all)
    run_tests
    run_bench llama-1b
    ;;
esac
echo
echo "summary: $summary"
