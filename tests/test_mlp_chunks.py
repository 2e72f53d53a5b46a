"""patch(mlp_chunks=...) against the live reference: the same tiny model patched with mlp_chunks=False (fp32, CPU).

A chunk of 7 tokens over a 50-token packed batch (8 chunks, the last one of 1 token). The math is the same per token,
but not bit for bit in general, so results are compared with a tight tolerance: the CPU's BLAS picks its kernel by
matrix shape, so a token's MLP output can round differently in a 7-row matmul than in a 50-row one (measured: equal
for the tiny Llama, up to 6e-8 apart for the tiny Falcon's MLP), and a weight's gradient is a sum over tokens that
chunking splits into one matmul per chunk plus their sum (another summation order).
"""
from __future__ import annotations

import copy

import pytest
import torch

import hf_accel
from hf_accel.errors import ConfigurationError
from hf_accel.fused.compiling import graphs_compiled
from hf_accel.memory import mlp_chunks
from hf_accel.memory.targets import decoder_mlps
from script_modules import script_module
import tiny_models
from tiny_models import VOCAB, loss_and_grads, make

CHUNK = 7
LENGTHS = (20, 18, 12)  # 50 tokens: 8 chunks of CHUNK, the last one of 1
LOSS_RTOL = 1e-6  # fp32 both sides, rounding only (measured: up to 1e-7)
GRAD_RTOL = 1e-5  # fp32 both sides, rounding and summation order only (measured: up to 3e-7 of the largest entry)
FAMILIES = ("llama-gqa", "neox-parallel", "neox-sequential", "falcon-mha", "falcon-rw-alibi")


def packed_batch() -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, sum(LENGTHS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return dict(input_ids=ids, position_ids=pos, labels=ids.masked_fill(pos == 0, -100))


def assert_same_step(ours, ref, batch) -> None:
    tiny_models.assert_same_step(ours, ref, batch, loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL)


class ChunkCounter:
    """Counts calls of each decoder MLP's first child module (a projection): one per chunk when chunked."""

    def __init__(self, model):
        self.calls = 0
        self.handles = [next(mlp.children()).register_forward_hook(self._count) for _, mlp in decoder_mlps(model)]

    def _count(self, *_):
        self.calls += 1

    def remove(self):
        for handle in self.handles:
            handle.remove()


def chunked_pair(variant: str, checkpointing=None, wrap=lambda m: m):
    ref = wrap(make(variant).train())
    ours = copy.deepcopy(ref)
    hf_accel.patch(ref, backend="reference", checkpointing=checkpointing, mlp_chunks=False)
    report = hf_accel.patch(ours, backend="reference", checkpointing=checkpointing, mlp_chunks=CHUNK)
    assert report.mlp_chunks.startswith(f"training calls over {CHUNK} tokens")
    return ours, ref


@pytest.mark.parametrize("checkpointing", [None, "full", "offload"])
@pytest.mark.parametrize("variant", FAMILIES)
def test_chunked_mlp_gives_the_same_loss_and_gradients(variant, checkpointing):
    ours, ref = chunked_pair(variant, checkpointing)
    batch = packed_batch()
    counter = ChunkCounter(ours)
    assert_same_step(ours, ref, batch)
    counter.remove()
    chunks, mlps = -(-sum(LENGTHS) // CHUNK), len(decoder_mlps(ours))
    # forward, then in backward the chunks' recompute, and with a checkpointed layer its recompute, which torch stops
    # early once everything backward needs is back (the layer's last chunk input is saved before that chunk runs)
    assert counter.calls == (2 * chunks if checkpointing is None else 3 * chunks - 1) * mlps


@pytest.mark.parametrize("checkpointing", [None, "full"])
@pytest.mark.parametrize("variant", ["llama-gqa", "neox-parallel", "falcon-mha"])
def test_a_chunk_s_recompute_skips_the_mlp_output_projection(variant, checkpointing, monkeypatch):
    """A chunk's recompute throws its output away, so it skips the MLP's output projection (memory.trim): with NaN
    in the skipped outputs the step is still the unchunked one, and each chunk's recompute skipped one matmul (a
    checkpointed layer's recompute too, whose chunks run inside it)."""
    from hf_accel.memory import trim

    monkeypatch.setattr(trim, "FILL", float("nan"))
    ours, ref = chunked_pair(variant, checkpointing)
    skipped = trim.STATS.skipped
    assert_same_step(ours, ref, packed_batch())
    chunks, mlps = -(-sum(LENGTHS) // CHUNK), len(decoder_mlps(ours))
    assert trim.STATS.skipped - skipped >= chunks * mlps


def test_chunked_mlp_with_op_level_checkpointing():
    ours, ref = chunked_pair("llama-gqa", "op")
    assert_same_step(ours, ref, packed_batch())


@pytest.mark.parametrize("checkpointing", [None, "offload"])
def test_chunked_mlp_with_lora(checkpointing):
    peft = pytest.importorskip("peft")

    def lora(model):
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj",
                                                                 "down_proj"]))
        for name, p in model.named_parameters():  # lora_B starts at zero, which would make lora_A's grad zero
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
        return model

    ours, ref = chunked_pair("llama-gqa", checkpointing, wrap=lora)
    batch = packed_batch()
    counter = ChunkCounter(ours)
    assert_same_step(ours, ref, batch)
    assert counter.calls > len(decoder_mlps(ours)) * 2  # it chunked
    _, grads = loss_and_grads(ours, batch)
    assert any("mlp" in n and "lora_A" in n for n in grads) and all("lora_" in n for n in grads)
    assert all(g.abs().max() > 0 for g in grads.values())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_dropout_inside_a_chunked_mlp_is_said_once(dropout, caplog):
    """LoRA dropout on the MLP's projections draws its masks chunk by chunk: the same distribution, not the masks
    of one draw over every token, so not the unpatched model's step for a seed. The first chunked call says so (once);
    without dropout nothing is said (and the step is the unpatched one: test_chunked_mlp_with_lora)."""
    peft = pytest.importorskip("peft")

    def lora(model):
        return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_dropout=dropout,
                                                          target_modules=["gate_proj", "up_proj", "down_proj"]))

    ours, _ = chunked_pair("llama-gqa", wrap=lora)
    with caplog.at_level("WARNING", logger="hf_accel"):
        for _ in range(2):
            loss_and_grads(ours, packed_batch())
    said = [r.getMessage() for r in caplog.records if "dropout inside it" in r.getMessage()]
    assert len(said) == (1 if dropout else 0)  # once per model, not per call or per layer
    assert all("lora_dropout=0" in m and "lora_dropout.default" in m for m in said)


@pytest.mark.parametrize("mode", ["eval", "no_grad", "short"])
def test_other_calls_run_the_original_forward(mode, monkeypatch):
    model = make("llama-gqa").train()
    hf_accel.patch(model, backend="reference", mlp_chunks=CHUNK if mode != "short" else 64)
    chunked = []
    monkeypatch.setattr(mlp_chunks, "run_in_chunks", lambda *a: chunked.append(a) or pytest.fail("chunked"))
    counter = ChunkCounter(model)
    batch = packed_batch()
    if mode == "eval":
        model.eval()
    with torch.set_grad_enabled(mode != "no_grad"):
        model(**batch)
    assert not chunked and counter.calls == len(decoder_mlps(model))  # one call per MLP: the whole batch at once


def test_unpatch_restores_each_mlp_forward():
    model = make("llama-gqa").train()
    mlps = [mlp for _, mlp in decoder_mlps(model)]
    own = lambda x: type(mlps[1]).forward(mlps[1], x)  # noqa: E731 (what fused_ops binds: an instance forward)
    mlps[1].forward = own
    report = hf_accel.patch(model, backend="reference", mlp_chunks=CHUNK)
    assert all(mlp_chunks.chunking_of(mlp) is not None for mlp in mlps)
    assert f"mlp_chunks: training calls over {CHUNK} tokens" in str(report)
    loss_and_grads(model, packed_batch())  # a chunked step binds the trimmed down_proj forwards
    assert all("forward" in mlp.down_proj.__dict__ for mlp in mlps)
    hf_accel.unpatch(model)
    assert "forward" not in mlps[0].__dict__
    assert mlps[1].__dict__["forward"] is own
    assert not any("forward" in mlp.down_proj.__dict__ for mlp in mlps)


def test_the_bound_forward_is_what_runs_per_chunk():
    """What fused_ops binds (liger's SwiGLU, an instance forward) serves each chunk."""
    calls = []

    def bind_fused(model):
        for _, mlp in decoder_mlps(model):
            def fused(x, mlp=mlp):
                calls.append(x.shape[0])
                return type(mlp).forward(mlp, x)

            mlp.forward = fused
        return model

    ref, model = bind_fused(make("llama-gqa").train()), bind_fused(make("llama-gqa").train())
    hf_accel.patch(ref, backend="reference", mlp_chunks=False)
    hf_accel.patch(model, backend="reference", mlp_chunks=CHUNK)
    loss, grads = loss_and_grads(model, packed_batch())
    assert calls and set(calls) == {CHUNK, sum(LENGTHS) % CHUNK}  # only chunks, never the whole batch
    calls.clear()
    assert_same_step(model, ref, packed_batch())


def _mlp_saved_bytes(model, batch) -> int:
    """Bytes autograd keeps for backward from inside the decoder MLPs during one training forward."""
    inside, saved = [False], [0]

    def pack(t):
        if inside[0]:
            saved[0] += t.numel() * t.element_size()
        return t

    hooks = []
    for _, mlp in decoder_mlps(model):
        hooks.append(mlp.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)))
        hooks.append(mlp.register_forward_hook(lambda *_: inside.__setitem__(0, False)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    for h in hooks:
        h.remove()
    loss.backward()
    return saved[0]


def test_chunking_keeps_only_the_mlp_inputs_for_backward():
    model = make("llama-gqa").train()
    config = model.config
    hf_accel.patch(model, backend="reference", mlp_chunks=False)
    batch = packed_batch()
    tokens, mlps = sum(LENGTHS), config.num_hidden_layers
    unchunked = _mlp_saved_bytes(model, batch)
    assert unchunked >= mlps * tokens * 3 * config.intermediate_size * 4  # gate, up, their product (at least)
    hf_accel.patch(model, backend="reference", mlp_chunks=CHUNK)
    chunked = _mlp_saved_bytes(model, batch)
    assert chunked == mlps * tokens * config.hidden_size * 4  # each chunk's input, nothing else


def test_auto_sizes_chunks_by_intermediate_and_turns_on_over_the_threshold():
    chunking = mlp_chunks.resolve("auto", 14336, 2)  # Llama-3-8B, bf16: 16 GiB of intermediates at 199,728 tokens
    assert chunking == mlp_chunks.MlpChunking(12288, 199728, auto=True)
    assert 131072 < chunking.min_tokens < 262144  # issue 22: 128k documents unchanged, 256k chunked
    assert mlp_chunks.resolve("auto", 8192, 2).min_tokens > 16384 * 20  # Llama-1B packed batches: never
    assert mlp_chunks.resolve("auto", 1 << 20, 4).chunk_tokens == mlp_chunks.AUTO_MIN_CHUNK
    assert mlp_chunks.resolve("auto", 1 << 20, 4).min_tokens == mlp_chunks.AUTO_MIN_TOKENS
    at = torch.empty(1, chunking.min_tokens, 8, device="meta")
    over = torch.empty(2, chunking.min_tokens // 2 + 1, 8, device="meta")
    assert chunking.chunk_for(at, training=True) == 0
    assert chunking.chunk_for(over, training=True) == 12288
    assert chunking.chunk_for(over, training=False) == 0
    with torch.no_grad():
        assert chunking.chunk_for(over, training=True) == 0
    model = make("llama-gqa").train()
    report = hf_accel.patch(model, backend="reference")  # the default
    expected = mlp_chunks.auto_min_tokens(model.config.intermediate_size, 4)
    assert report.mlp_chunks.startswith(f"auto: training calls over {expected} tokens")


@pytest.mark.parametrize("setting", [False, 0, None])
def test_off(setting):
    model = make("llama-gqa").train()
    report = hf_accel.patch(model, backend="reference", mlp_chunks=setting)
    assert report.mlp_chunks.startswith("off")
    assert all(mlp_chunks.chunking_of(mlp) is None for _, mlp in decoder_mlps(model))


@pytest.mark.parametrize("setting", [-8, "yes", True, 1.5])
def test_bad_settings_say_what_is_allowed(setting):
    with pytest.raises(ConfigurationError, match="mlp_chunks must be 'auto', a chunk size in tokens"):
        hf_accel.patch(make("llama-gqa"), backend="reference", mlp_chunks=setting)


@pytest.mark.slow  # dynamo compiles
def test_chunks_inside_compiled_layers():
    """Compiled layers (aot_eager: dynamo + AOTAutograd, no code generation) break their graph around a chunked MLP,
    which runs eagerly in chunks; the result matches the eager unchunked model."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ours = make("llama-gqa").train()
    ref = copy.deepcopy(ours)
    hf_accel.patch(ref, backend="reference", mlp_chunks=False)
    report = hf_accel.patch(ours, backend="reference", compile={"backend": "aot_eager"}, mlp_chunks=CHUNK)
    assert report.compiled_layers and "graph break" in report.mlp_chunks
    counter = ChunkCounter(ours)
    batch = packed_batch()
    assert_same_step(ours, ref, batch)
    assert counter.calls == 2 * -(-sum(LENGTHS) // CHUNK) * len(decoder_mlps(ours))
    assert graphs_compiled() > 0  # the layers did take the compiled path
    torch._dynamo.reset()


@pytest.mark.slow  # dynamo compiles
def test_a_budget_s_chunking_reaches_compiled_layers(monkeypatch):
    """A memory budget may make auto's chunking cover every call over one chunk (``chunk_every_long_call``) after the
    layers were compiled, and put it back (``restore_bound``): the compiled layers follow each change (their graphs
    are guarded on the chunking), and every step matches the eager unchunked model."""
    for name, value in (("AUTO_MIN_TOKENS", 4 * sum(LENGTHS)), ("AUTO_TRIGGER_BYTES", 0), ("AUTO_CHUNK_BYTES", 0),
                        ("AUTO_MIN_CHUNK", CHUNK)):
        monkeypatch.setattr(mlp_chunks, name, value)  # auto: chunks of CHUNK, but only for calls over 200 tokens
    torch._dynamo.reset()
    ours = make("llama-gqa").train()
    ref = copy.deepcopy(ours)
    hf_accel.patch(ref, backend="reference", mlp_chunks=False)
    hf_accel.patch(ours, backend="reference", compile={"backend": "aot_eager"})
    batch, mlps = packed_batch(), len(decoder_mlps(ours))
    chunked_calls = 2 * -(-sum(LENGTHS) // CHUNK) * mlps  # forward and the chunks' recompute
    for every_call, calls in ((False, mlps), (True, chunked_calls), (False, mlps)):
        if every_call:
            mlp_chunks.chunk_every_long_call(ours)
        else:
            mlp_chunks.restore_bound(ours)
        counter = ChunkCounter(ours)
        assert_same_step(ours, ref, batch)
        counter.remove()
        assert counter.calls == calls, every_call
    assert graphs_compiled() > 0
    torch._dynamo.reset()


def test_bench_best_flag_reaches_the_child_and_patch(monkeypatch):
    """hf_accel-best takes patch()'s default ("auto": on for the long-context preset's 32k-256k documents);
    --best-mlp-chunks overrides it, and the plain hf_accel config keeps it off."""
    from pathlib import Path

    from benchlib import configs

    bench = script_module("bench")
    assert bench.options(bench.parse_args(["--preset", "long-context"])).mlp_chunks == "auto"
    args = bench.parse_args(["--preset", "long-context", "--best-mlp-chunks", "8192"])
    assert bench.options(args).mlp_chunks == 8192
    argv = bench.child_argv(args, "hf_accel-best", Path("r.json"))
    assert argv[argv.index("--best-mlp-chunks") + 1] == "8192"
    assert configs.Options().mlp_chunks == "auto"


def test_sft_flag_and_accel_arguments():
    from hf_accel.cli import sft
    from hf_accel.training.trainer import AccelArguments

    assert AccelArguments().mlp_chunks == "auto"
    assert [sft.parse_args(a).mlp_chunks for a in ([], ["--mlp-chunks", "8192"], ["--mlp-chunks", "off"])] == \
        ["auto", 8192, 0]
