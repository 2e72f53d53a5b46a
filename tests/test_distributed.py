"""Multi-process readiness, on CPU: the accelerate configs in examples/accelerate load and say what the docs claim,
the patch keeps what FSDP wraps and never reads weights (ZeRO-3 partitions them), checkpoint policies stand down
under FSDP's own activation checkpointing, and a 2-process DDP run (gloo) trains exactly like 1 process over the same
global batches, and a 2-process FSDP2 run (gloo, tests/dist_fsdp.py) with the fused loss trains like 1 process, saves
a model that from_pretrained loads, and exits. What needs GPUs (speed, memory, bf16, ZeRO-3) is listed in
docs/MULTI_GPU.md.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hf_accel
from hf_accel.memory.checkpointing import decoder_layers, policy_from_spec
from benchlib.distributed import free_port, launch_argv
from hf_accel.errors import ConfigurationError

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_fsdp  # noqa: E402
from multi_gpu_runs import launch_or_fail  # noqa: E402
import tiny_models  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "examples" / "accelerate"
FAMILIES = ["llama-gqa", "neox-parallel", "falcon-40b-newarch", "falcon-rw-alibi"]
# Same samples per optimizer step, fp32: only the order of the gradient all-reduce (2 ranks) vs accumulation
# (1 process) and, for a different grouping, the packed row layout differ, so results agree to fp32 rounding.
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5
SFT_RUN_TIMEOUT_S = 300  # a 4-step run takes ~20 s; longer means a rank waits in a collective


# ------------------------------------------------------------------------------------------------ config files
def _launch_env(config: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file <config>` gives its processes (accelerate's own parsing)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / config), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        return prepare_deepspeed_cmd_env(args)[1]
    return prepare_multi_gpu_env(args)


@pytest.mark.parametrize("config, distributed_type", [
    ("fsdp2.yaml", "FSDP"), ("fsdp2_checkpointing.yaml", "FSDP"), ("deepspeed_zero3.yaml", "DEEPSPEED"),
    ("ddp_cpu.yaml", "MULTI_GPU"),  # MULTI_GPU = torchrun launcher; the processes run on CPU (see the file)
    ("deepspeed_zero3_cpu.yaml", "DEEPSPEED"),  # tests/test_zero3.py
])
def test_config_loads_with_accelerate(config, distributed_type):
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = ClusterConfig.from_yaml_file(str(CONFIGS / config))
    assert cfg.distributed_type == distributed_type and cfg.num_processes == 2 and cfg.num_machines == 1


@pytest.mark.parametrize("config, activation_checkpointing", [
    ("fsdp2.yaml", False), ("fsdp2_checkpointing.yaml", True),
])
def test_fsdp2_plugin_from_config(monkeypatch, config, activation_checkpointing):
    """accelerate builds an FSDP2 plugin from the file, with the activation-checkpointing env var that
    hf_accel.memory.checkpointing reads to stand down."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    env = _launch_env(config)
    assert env["ACCELERATE_USE_FSDP"] == "true"
    assert env["FSDP_ACTIVATION_CHECKPOINTING"] == str(activation_checkpointing).lower()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.activation_checkpointing is activation_checkpointing
    assert plugin.transformer_cls_names_to_wrap is None  # wrap the model's own _no_split_modules


def test_deepspeed_zero3_config(monkeypatch):
    """The yaml points at the json (relative to the repository root) and accelerate reads ZeRO stage 3 from it,
    with every batch-size / accumulation field left "auto" for the Trainer to fill."""
    from accelerate.utils import DeepSpeedPlugin

    env = _launch_env("deepspeed_zero3.yaml")
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert (ROOT / env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]).is_file()
    monkeypatch.chdir(ROOT)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == 3 and plugin.hf_ds_config.is_zero3() and not plugin.hf_ds_config.is_offload()
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping"):
        assert plugin.deepspeed_config[key] == "auto", key


# ------------------------------------------------------------------------------------------------ patch vs sharding
@pytest.mark.parametrize("name", FAMILIES)
def test_fsdp2_wraps_the_same_layers_after_patch(monkeypatch, name):
    """FSDP2 finds its units by layer class; the patch rebinds attention methods and changes no class."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    for key, value in _launch_env("fsdp2.yaml").items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    model = tiny_models.make(name)
    before = [n for n, m in model.named_modules() if fsdp2_prepare_auto_wrap_policy(plugin, model)(m)]
    hf_accel.patch(model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    after = [n for n, m in model.named_modules() if policy(m)]
    assert after == before and len(after) == len(decoder_layers(model)) == model.config.num_hidden_layers


class _ParameterReads(TorchDispatchMode):
    """Records every op that receives a tensor sharing storage with one of the given parameters."""

    def __init__(self, params) -> None:
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr() for p in params}
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages
               for t in tree_leaves((args, kwargs))):
            self.ops.append(str(func))
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", FAMILIES)
def test_patch_reads_no_parameter(name):
    model = tiny_models.make(name)
    params = list(model.parameters())
    with _ParameterReads(params) as reads:
        hf_accel.patch(model, checkpointing="every_2")
    assert reads.ops == []
    assert all(p is q for p, q in zip(params, model.parameters()))
    with _ParameterReads(params) as reads:  # the recorder does see reads: a forward reads every weight
        model(torch.randint(0, tiny_models.VOCAB, (1, 8)))
    assert reads.ops


@pytest.mark.parametrize("name", FAMILIES)
def test_patch_under_zero3_style_partitioned_parameters(name):
    """ZeRO-3 leaves each rank a 0-element placeholder per parameter until it gathers them for a forward: patching
    then, and running with the full weights later, gives what patching a whole model gives."""
    reference, model = tiny_models.make(name), tiny_models.make(name)
    hf_accel.patch(reference)
    full = {n: p.data for n, p in model.named_parameters()}
    for p in model.parameters():
        p.data = torch.empty(0, dtype=p.dtype)
    report = hf_accel.patch(model)
    for n, p in model.named_parameters():
        p.data = full[n]
    assert report.backend == hf_accel.patch(reference).backend
    input_ids = torch.randint(0, tiny_models.VOCAB, (1, 12))
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])  # two packed documents
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids, position_ids=position_ids).logits,
                                   reference(input_ids, position_ids=position_ids).logits, rtol=0, atol=0)


def test_patch_on_meta_device():
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = tiny_models.VARIANTS["llama-gqa"]()
    with _ParameterReads([]) as reads:
        hf_accel.patch(model)
    assert all(p.device.type == "meta" for p in model.parameters()) and reads.ops == []


# ------------------------------------------------------------------------------------------------ checkpointing
@pytest.mark.parametrize("config, stands_down", [("fsdp2_checkpointing.yaml", True), ("fsdp2.yaml", False)])
def test_checkpoint_policy_under_fsdp_activation_checkpointing(monkeypatch, config, stands_down):
    """With the env accelerate sets from fsdp2_checkpointing.yaml, an explicit policy raises (FSDP + model
    checkpointing at once fail) and an implicit one stands down; with fsdp2.yaml both apply."""
    for key, value in _launch_env(config).items():
        monkeypatch.setenv(key, value)
    model = tiny_models.make("llama-gqa")
    if stands_down:
        with pytest.raises(ConfigurationError, match="FSDP"):
            hf_accel.patch(model, checkpointing="full")
        assert hf_accel.patch_report(model) is None  # the failed patch rolled itself back
    else:
        hf_accel.patch(model, checkpointing="full")
        assert all(layer.gradient_checkpointing for layer in decoder_layers(model))
        hf_accel.unpatch(model)
    policy_from_spec("full", explicit=False).apply(model)
    assert all(layer.gradient_checkpointing for layer in decoder_layers(model)) == (not stands_down)


# ------------------------------------------------------------------------------------------------ 2-process DDP run
def _launch_or_fail(cmd: list[str], cwd: Path, timeout: float) -> str:
    """A CPU launch (one thread per rank) that must exit 0 within `timeout`; a hang kills the group and fails."""
    return launch_or_fail(cmd, cwd, timeout, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory) -> Path:
    """A small prompt/completion jsonl and a saved tiny Llama + tokenizer (offline)."""
    from hf_accel.data.default_task import build_tokenizer, make_examples, tiny_llama

    root = tmp_path_factory.mktemp("dist")
    (root / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in make_examples(256, seed=3)))
    tokenizer = build_tokenizer()
    tiny_llama(len(tokenizer), seed=0).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root


def _run_sft(root: Path, out: str, *args: str, processes: int = 1) -> tuple[dict, dict]:
    """(metrics of rank 0, model state) of scripts/sft.py run through tests/dist_sft.py."""
    common = ["--model", "model", "--dataset", "data.jsonl", "--lr", "3e-3", "--max-steps", "4",
              "--logging-steps", "1", "--eval-examples", "0", "--output-dir", out, *args]
    script = str(ROOT / "tests" / "dist_sft.py")
    if processes == 1:
        cmd = [sys.executable, script]
    else:
        cmd = launch_argv(CONFIGS / "ddp_cpu.yaml", processes, [script])
    _launch_or_fail(cmd + common, root, SFT_RUN_TIMEOUT_S)
    from safetensors.torch import load_file

    names = ["metrics.json"] + [f"metrics.rank{r}.json" for r in range(1, processes)]
    metrics = [json.loads((root / out / f"rank{r}" / names[r]).read_text()) for r in range(processes)]
    assert all(m["losses"] == metrics[0]["losses"] for m in metrics)  # every rank logs the global loss
    return metrics[0], load_file(root / out / "rank0" / "model.safetensors")


def _assert_same_training(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    (metrics_a, weights_a), (metrics_b, weights_b) = a, b
    assert metrics_a["steps"] == metrics_b["steps"] == 4
    assert metrics_a["backend"] == metrics_b["backend"] != "stock"
    torch.testing.assert_close(torch.tensor(metrics_a["losses"]), torch.tensor(metrics_b["losses"]),
                               rtol=LOSS_RTOL, atol=0)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        torch.testing.assert_close(weights_a[name], weights_b[name], rtol=0, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.slow
def test_two_process_ddp_matches_one_process(sft_inputs):
    """Token budget: the sampler deals global batch i to rank i % 2, and the Trainer takes grad_accum consecutive
    batches per rank, so 2 ranks x grad_accum 2 cover the same 4 global batches per step as 1 process x
    grad_accum 4; the loss divides by the step's target count summed over ranks. Fixed examples per micro-batch:
    2 ranks x 4 examples = the same 8 samples as 1 process x 8 examples (packed into different rows)."""
    budget = ["--max-tokens-per-batch", "160"]
    _assert_same_training(_run_sft(sft_inputs, "budget-2p", *budget, "--grad-accum", "2", processes=2),
                          _run_sft(sft_inputs, "budget-1p", *budget, "--grad-accum", "4"))
    _assert_same_training(_run_sft(sft_inputs, "examples-2p", "--batch-size", "4", processes=2),
                          _run_sft(sft_inputs, "examples-1p", "--batch-size", "8"))


def test_patch_that_raises_leaves_the_model_as_it_was(monkeypatch):
    for key, value in _launch_env("fsdp2_checkpointing.yaml").items():
        monkeypatch.setenv(key, value)
    model = tiny_models.make("llama-gqa")
    with pytest.raises(ConfigurationError, match="FSDP"):
        hf_accel.patch(model, checkpointing="full")
    assert model.config._attn_implementation == "sdpa" and not model._forward_pre_hooks


@pytest.mark.slow
def test_two_process_ddp_fused_ce_matches_one_process(sft_inputs):
    """fused_ce computes the loss inside the model's forward (patch(fused_ce=True)), so DDP reduces its gradients:
    2 processes x grad-accum 1 train like 1 process x grad-accum 2. (It used to run outside the wrapper and drift.)"""
    budget = ["--max-tokens-per-batch", "160", "--fused-ce"]
    _assert_same_training(_run_sft(sft_inputs, "fused-2p", *budget, processes=2),
                          _run_sft(sft_inputs, "fused-1p", *budget, "--grad-accum", "2"))


# ------------------------------------------------------------------------------------------------ 2-process FSDP2 run
FSDP_RUN_TIMEOUT_S = 150  # the run takes ~25 s on 2 busy cores; longer means a rank waits in a collective
FSDP_GRAD_ATOL = 1e-6  # fp32; measured: identical (two ranks' halves summed vs two micro-batches accumulated)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("fsdp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "tests" / "dist_fsdp.py"), "--out", str(out)]
    _launch_or_fail(cmd, out, FSDP_RUN_TIMEOUT_S)
    return out, json.loads((out / "report.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama-tied", "neox", "falcon", "llama-checkpointed", "llama-compiled"])
def test_fsdp2_fused_ce_two_processes_match_one(fsdp_run, case):
    """FSDP2 over gloo, every parameter a sharded DTensor (accelerate's layout for Llama and Falcon, tied embeddings;
    for GPT-NeoX the LM head as its own unit, freed after forward). Fused loss in 16-token chunks, so ranks run
    different numbers of chunks; for llama-tied and neox on the collator's target rows only (the reference computes
    every row). Against 1 process x grad-accum 2 on the same global micro-batches: the full gradients
    after the first backward (the inline path's weight gradient reaches the sharded parameter through FSDP's
    reduce-scatter), the per-step losses, and the saved model loaded with from_pretrained.

    It failed before the loss ran as one call of the head: a call per chunk made one reduce-scatter per chunk, ranks
    with different chunk counts mismatched their collectives (gloo: "Received data size doesn't match"; NCCL: a
    hang), and torch <= 2.12 recomputed a chunk against the already re-sharded weight ("mixed torch.Tensor and
    DTensor").

    llama-checkpointed checkpoints every decoder layer with a trimmed recompute (its trained down_proj's matmul
    skipped, 2 layers x 3 steps), the reference untrimmed. llama-compiled compiles the decoder layers (the default
    tracing, nested graph breaks; FSDP2's hooks inside the compiled calls), the reference eager."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, reports = fsdp_run
    report = reports[case]
    assert report["sharded"], "FSDP2 left some parameter unsharded: the run would not test sharding"
    assert report["trim_skipped"] == (2 * dist_fsdp.STEPS if case in dist_fsdp.CHECKPOINTED_CASES else 0)
    if case in dist_fsdp.COMPILED_CASES:  # the layers trained through their graphs, traced with nested breaks
        assert report["compiled_layers"] == 2 and report["nested_breaks"] and report["graphs_compiled"] > 0, report
    assert report["head_calls_forward_backward"] == 1, "the fused loss must call the LM head module exactly once"
    # the collator's target rows (llama-tied, neox): the head computed those rows only, and trained like every row
    want_rows = report["targets"] if report["target_rows"] else report["positions"]
    assert report["head_rows"] == want_rows and report["target_rows"] == (case in dist_fsdp.TARGET_ROWS_CASES)
    assert "_GradInForwardLinearCEBackward" in report["loss_nodes"], "FSDP-wrapped nn.Linear head: inline path"
    grads, want = (load_file(out / case / f"grads-{kind}.safetensors") for kind in ("fsdp", "reference"))
    assert grads.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=0, atol=FSDP_GRAD_ATOL, msg=name)
    torch.testing.assert_close(torch.tensor(report["losses"]), torch.tensor(report["reference_losses"]),
                               rtol=LOSS_RTOL, atol=0)
    saved, reference = (AutoModelForCausalLM.from_pretrained(out / case / kind) for kind in ("fsdp", "reference"))
    got, expected = saved.state_dict(), reference.state_dict()
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=WEIGHT_ATOL, msg=name)
    initial = dist_fsdp.build(*dist_fsdp.CASES[case][:2]).state_dict()
    assert all(not torch.equal(expected[n], initial[n]) for n in expected), "some weight did not train"
