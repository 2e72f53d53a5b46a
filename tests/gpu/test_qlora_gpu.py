"""QLoRA through PEFT with hf_accel.patch (issues 20b, 38b): a small random Llama saved and reloaded in bitsandbytes
NF4 (bf16 compute), prepare_model_for_kbit_training (its checkpointing on), PEFT LoRA on every linear, then
`hf_accel.patch(model)` with its defaults, which now include compiled decoder layers on the 4-bit base (bitsandbytes'
matmul and dequantize stay custom ops inside the graphs), the LoRA cast skip on PEFT's 4-bit layers and the
checkpointed layers' inputs in pinned host memory (issue 38c: the defaults' storage for a 4-bit base) and the trimmed
recompute (each layer's recompute skips the frozen 4-bit down_proj; its skipped output is NaN here). Over 20 AdamW
steps the per-step losses (and the first step's LoRA gradients) stay within the bf16 error of the unpatched QLoRA
model, measured in the same test against the same quantized model computing in fp32 (flash-attn's test rule). The
fused loss and liger's fused ops stay on; the report says what ran.

Needs bitsandbytes (CUDA build): `source .gpu/bnb/install.sh` first (see the lead's pack-wheels.sh line)."""
from __future__ import annotations

import pytest
import torch

import hf_accel
from test_models_gpu import packed

pytestmark = pytest.mark.gpu
bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes not installed (pack-wheels.sh bnb bitsandbytes==...)")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 20
BF16_FACTOR = 2.0  # ours vs the bf16 unpatched run may differ by this much times the unpatched run's own error
LOSS_FLOOR = 1e-4  # relative: when the unpatched run's error happens to be ~0 at every step


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                         num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                                         tie_word_embeddings=False)).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("qlora-llama")
    model.save_pretrained(folder)
    return folder


def qlora(folder, compute_dtype: torch.dtype, patch: str | None):
    """NF4 base (compute in `compute_dtype`), kbit preparation, LoRA r=16 on every linear (random B, seeded), and
    hf_accel.patch(model) before or after LoRA (or not at all; "after-lora-without-nested-breaks": the layers traced
    without the default's nested graph breaks, issue 39c); returns (model, report)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa", device_map={"": 0})
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    options = {"compile": {"nested_graph_breaks": False}} if (patch or "").endswith("-without-nested-breaks") else {}
    report = hf_accel.patch(model, **options) if patch == "before-lora" else None
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS,
                                             init_lora_weights=False, task_type="CAUSAL_LM"))
    if (patch or "").startswith("after-lora"):
        report = hf_accel.patch(model, **options)
    return model.train(), report


def train(model, autocast: bool) -> tuple[list[float], torch.Tensor]:
    """STEPS AdamW steps on one packed batch (documents restart position_ids): losses, and the first step's LoRA grads."""
    batch = {k: v.cuda() for k, v in packed(32000).items()}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    losses, first_grads = [], None
    for _ in range(STEPS):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch, use_cache=False).loss
        loss.backward()
        if first_grads is None:
            first_grads = torch.cat([p.grad.float().flatten() for p in params])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, first_grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("order", ["after-lora", "before-lora", "after-lora-without-nested-breaks"])
def test_qlora_patched_with_defaults_trains_within_bf16_error_of_unpatched(saved_llama, order, monkeypatch):
    from torch._dynamo.utils import counters

    from hf_accel.memory import trim

    monkeypatch.setattr(trim, "FILL", float("nan"))  # the trimmed recompute's skipped outputs: nothing may read them

    torch._dynamo.reset()
    counters.clear()
    ref32, _ = qlora(saved_llama, torch.float32, patch=None)
    losses32, grads32 = train(ref32, autocast=False)
    del ref32
    ref16, _ = qlora(saved_llama, torch.bfloat16, patch=None)
    losses16, grads16 = train(ref16, autocast=True)
    del ref16
    ours, report = qlora(saved_llama, torch.bfloat16, patch=order)
    skipped = trim.STATS.skipped
    losses, grads = train(ours, autocast=True)
    skipped = trim.STATS.skipped - skipped
    print(report, "\nlosses fp32", losses32, "\nunpatched bf16", losses16, "\npatched", losses)

    baseline = max(abs(a - b) / abs(b) for a, b in zip(losses16, losses32))
    for step, (got, want) in enumerate(zip(losses, losses16)):
        assert abs(got - want) / abs(want) <= BF16_FACTOR * baseline + LOSS_FLOOR, (step, losses, losses16, losses32)
    assert losses[-1] < losses[0]  # it trains
    assert grads.norm() > 0 and rel(grads, grads32) <= BF16_FACTOR * rel(grads16, grads32) + 1e-3

    # what ran on the 4-bit layers: the fused loss on the fp32 LM head, liger's norms / SwiGLU (for eager calls),
    # compiled decoder layers with bitsandbytes' ops inside their graphs (breaks at the attention seam only), the cast
    # skip bound to PEFT's 4-bit LoRA layers
    import importlib.util

    assert report.fused_ce and report.fused_ops == (importlib.util.find_spec("liger_kernel") is not None), str(report)
    assert report.compiled_layers == 4, str(report)
    assert any(line.startswith("compile: on") for line in report.speedups), report.speedups
    assert not any(n.startswith("LoRA cast skip") for n in report.notes), report.notes
    assert counters["stats"]["unique_graphs"] > 0
    assert all("hf_accel_attention" in reason for reason in counters["graph_break"]), list(counters["graph_break"])
    # and the checkpointed layers' inputs went to host memory (the defaults' storage for a 4-bit base)
    from hf_accel.memory.checkpointing import applied_policy

    policy = applied_policy(ours) or applied_policy(ours.get_base_model())
    assert report.checkpointing and "auto: a 4-bit base" in report.checkpointing, str(report)
    assert policy.offloader.stats.packed >= 4 and policy.offloader.stats.over_limit == 0, policy.offloader.stats
    # ... in memory page-locked by registering it on threads (cudaHostAlloc holds the GPU), decided at the first
    # pinned copy (None: the allocator was configured by the user, left alone)
    from hf_accel.memory import offload

    assert "settings" in offload._PINNING, "the offloader's pack did not decide the pinned memory's allocation"
    print("pinned host memory:", offload._PINNING["settings"])
    assert (offload._PINNING["settings"] or "pinned_use_cuda_host_register:True").startswith(
        "pinned_use_cuda_host_register:True")
    # and each layer's recompute skipped its frozen 4-bit down_proj (memory.trim), every step
    assert "skips the mlp.down_proj" in report.checkpointing and skipped == 4 * STEPS, (skipped, str(report))


@pytest.mark.parametrize("keep", [False, True], ids=["recipe", "keep-base-dtype"])
def test_sft_command_load_in_4bit_trains_within_bf16_error_of_stock(saved_llama, tmp_path, keep):
    """`hf-accel sft --load-in-4bit --bf16` on CUDA (the command's QLoRA: NF4 base on this GPU, PEFT's kbit
    preparation, LoRA r=16, hf_accel's Trainer with its defaults) against the same command with `--no-patch` (stock
    PEFT QLoRA), both measured against `--no-patch` computing in fp32: 20 steps of the default task's data. With
    `--keep-base-dtype` (the base's other weights back in bf16) for both bf16 runs."""
    import json
    import shutil

    from hf_accel.cli import sft
    from hf_accel.data.default_task import build_tokenizer, make_examples

    model_dir = tmp_path / "model"
    shutil.copytree(saved_llama, model_dir)
    build_tokenizer().save_pretrained(model_dir)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in make_examples(2000, seed=3)))
    common = ["--model", str(model_dir), "--dataset", str(data), "--load-in-4bit", "--lora-r", "16", "--max-steps",
              str(STEPS), "--logging-steps", "1", "--batch-size", "16", "--seed", "0"]
    losses = {}
    kept = ["--keep-base-dtype"] if keep else []
    for name, extra in {"fp32": ["--no-patch"], "stock": ["--no-patch", "--bf16", *kept],
                        "ours": ["--bf16", *kept]}.items():
        metrics = sft.main([*common, *extra, "--output-dir", str(tmp_path / name)])
        losses[name] = metrics["losses"]
        assert len(losses[name]) == STEPS and metrics["patched"] == (name == "ours")
    baseline = max(abs(a - b) / abs(b) for a, b in zip(losses["stock"], losses["fp32"]))
    for step, (got, want) in enumerate(zip(losses["ours"], losses["stock"])):
        assert abs(got - want) / abs(want) <= BF16_FACTOR * baseline + LOSS_FLOOR, (step, losses)
    assert losses["ours"][-1] < losses["ours"][0]


@pytest.mark.parametrize("compiled", [True, False])
def test_the_long_context_plan_shape_trains_as_full_checkpointing(saved_llama, compiled):
    """The plan a 344k-token Llama-3-8B QLoRA step ran under an 80 GB cap (run 31), small: offloaded heads and spaced
    layers, MLPs in chunks (each checkpointed, its recompute trimmed), compiled layers, liger's fused ops. That step
    failed in backward with torch's CheckpointError (a chunk's recompute saved the 4-bit weight its forward had not);
    here one step of that shape gives the loss and LoRA gradients of the same model under untrimmed full
    checkpointing with unchunked MLPs, within bf16 rounding (chunks change matmul shapes)."""
    from hf_accel.memory.checkpointing import FullCheckpointing, PerLayer

    def step(checkpointing, mlp_chunks):
        torch._dynamo.reset()
        model, _ = qlora(saved_llama, torch.bfloat16, patch=None)
        report = hf_accel.patch(model, checkpointing=checkpointing, mlp_chunks=mlp_chunks, compile=compiled)
        batch = {k: v.cuda() for k, v in packed(32000).items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch, use_cache=False).loss
        loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.requires_grad])
        return loss.item(), grads, report

    loss, grads, report = step(PerLayer(choices=["offload", "spaced", "offload", "spaced"]), 512)
    ref_loss, ref_grads, _ = step(FullCheckpointing(trim_recompute=False), False)
    assert "mlp_chunks" in str(report) and "spaced" in str(report.checkpointing), str(report)
    assert abs(loss - ref_loss) <= 1e-2 * abs(ref_loss), (loss, ref_loss)
    assert grads.norm() > 0 and rel(grads, ref_grads) <= 3e-2, rel(grads, ref_grads)


def test_the_bench_s_budget_row_under_a_long_context_plan_shape(monkeypatch):
    """The bench row run 31's 344k-token step failed in (`hf_accel-qlora-budget`: the NF4 base through PEFT's kbit
    recipe, LoRA, `patch(model, checkpointing=<budget>, context=...)` with every default, its probe included), tiny
    shapes on CUDA, with the plan forced to that step's shape (offloaded heads, spaced layers) and mlp_chunks="auto"'s
    thresholds lowered so its MLPs run in trimmed chunks: two steps train, and the first step's loss is that of the
    same row under full checkpointing within bf16 rounding."""
    import math

    from benchlib.configs import CONFIGS, Options
    from benchlib.train import RunSettings, Timing
    from benchlib.workloads import WORKLOADS, DataSpec, build_config, make_data

    from hf_accel.memory import mlp_chunks, trim
    from hf_accel.memory.budget import MemoryBudget
    from hf_accel.memory.checkpointing import applied_policy

    def run(checkpointing: str):
        settings = RunSettings(WORKLOADS["llama-8b-qlora"], "cuda", True, steps=2, warmup=0, step_time_budget=120.0)
        data = make_data(DataSpec.tiny(), build_config(settings.workload, tiny=True).vocab_size, steps=3)
        timing = Timing()
        model = CONFIGS["hf_accel-qlora-budget"].run(settings, data, Options(checkpointing=checkpointing), timing)
        return model, timing

    reference_model, reference = run("full")
    del reference_model
    monkeypatch.setattr(mlp_chunks, "auto_min_tokens", lambda *a: 64)
    monkeypatch.setattr(mlp_chunks, "auto_chunk_tokens", lambda *a: 32)
    monkeypatch.setattr(MemoryBudget, "layer_choices", lambda self, layers: (["offload", "spaced"] * 8)[:len(layers)])
    skipped = trim.STATS.skipped
    model, timing = run("budget:40GiB+offload")
    policy = applied_policy(model) or applied_policy(model.get_base_model())
    assert policy.spacer.stats.spaced > 0 and policy.offloader.stats.packed > 0, (policy.spacer.stats,
                                                                                  policy.offloader.stats)
    assert trim.STATS.skipped > skipped  # recomputes were trimmed ...
    report = next(n for n in timing.notes if n.startswith("patch: "))
    assert "training calls over 64 tokens run each decoder layer's MLP in chunks of 32" in report, report  # chunked
    assert len(timing.losses) == 2 and all(math.isfinite(x) for x in timing.losses)
    assert abs(timing.losses[0] - reference.losses[0]) <= 1e-2 * abs(reference.losses[0]), (timing.losses,
                                                                                           reference.losses)
