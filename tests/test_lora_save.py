"""A LoRA model's adapter, saved by hf_accel's Trainer, loads back onto a fresh base with the trained values: under
FSDP2 over gloo (2 processes, tests/dist_lora_save.py) with and without FSDP's activation checkpointing, and in one
process with the decoder layers in torch's ``CheckpointWrapper``.

It failed before the Trainer selected the adapter itself: peft matches state-dict keys against module names, which
keep ``_checkpoint_wrapped_module.`` while the state dict (accelerate's full state dict, or CheckpointWrapper's hook)
drops it, so ``adapter_model.safetensors`` came out empty (40 bytes) under fsdp2_checkpointing.yaml.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from benchlib.distributed import free_port
from hf_accel.errors import CheckpointError
from hf_accel.training import adapters

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_lora_save  # noqa: E402
from multi_gpu_runs import launch_into_new_folder_or_fail  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 120  # ~7 s on 2 cores; longer means a rank waits in a collective


def lora_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {adapters.plain_name(n): p.detach() for n, p in model.named_parameters() if "lora_" in n}


def assert_adapter_loads(adapter_dir: Path, trained: dict[str, torch.Tensor]) -> None:
    """A fresh base + PeftModel.from_pretrained(adapter_dir) has every LoRA tensor equal to ``trained``."""
    from peft import PeftModel
    from safetensors.torch import load_file

    saved = load_file(adapter_dir / adapters.ADAPTER_WEIGHTS_NAME)
    assert len(saved) == len(trained) > 0, f"the adapter file holds {len(saved)} tensors, trained {len(trained)}"
    torch.manual_seed(0)
    base = dist_lora_save.tiny_models.make("llama-gqa")
    loaded = lora_params(PeftModel.from_pretrained(base, adapter_dir))
    assert loaded.keys() == trained.keys()
    assert any("lora_B" in n and bool(t.abs().sum() > 0) for n, t in trained.items()), "lora_B did not train"
    for name, value in trained.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def fsdp_lora_run(tmp_path_factory) -> Path:
    """The three layouts' run, once more in a new folder if a gloo rank died of SIGSEGV (launch_into_new_folder_or_fail
    says when that happened under CI's load)."""
    def command(out: Path) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), str(ROOT / "tests" / "dist_lora_save.py"), "--out", str(out)]

    return launch_into_new_folder_or_fail(command, lambda: tmp_path_factory.mktemp("fsdp-lora"), RUN_TIMEOUT_S,
                                          env={"OMP_NUM_THREADS": "1"})


@pytest.mark.slow  # inductor / dynamo compiles or a multi-process launch: minutes on 2 cores
@pytest.mark.parametrize("layout", ["ac", "plain"])
def test_fsdp2_lora_adapter_holds_the_trained_values(fsdp_lora_run, layout):
    """layout "ac" = fsdp2_checkpointing.yaml (the empty adapter seen on 2 GPUs), "plain" = fsdp2.yaml."""
    from safetensors.torch import load_file

    assert_adapter_loads(fsdp_lora_run / layout / "adapter", load_file(fsdp_lora_run / layout / "trained.safetensors"))


def test_fsdp2_full_model_with_tied_embeddings_saves_them_once(fsdp_lora_run):
    """layout "full": a full fine-tune of a Llama with tied input / output embeddings under FSDP2. The gathered full
    state dict holds the embedding twice, as two separate tensors, and transformers drops only names that share one
    storage, so the save wrote ``lm_head.weight`` as well (seen on 2 GPUs: a second copy of the embedding in the file,
    1 GB for Llama-3.2-1B in fp32). The file holds it once, and from_pretrained gives exactly the trained values."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = fsdp_lora_run / "full" / "model"
    saved = load_file(folder / "model.safetensors")
    trained = load_file(fsdp_lora_run / "full" / "trained.safetensors")
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved, sorted(saved)
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.lm_head.weight is model.model.embed_tokens.weight
    loaded = {n: p.detach() for n, p in model.named_parameters()}
    assert loaded.keys() == trained.keys()
    for name, value in trained.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)


def test_trainer_saves_adapter_of_checkpoint_wrapped_layers(tmp_path):
    """One process, each decoder layer in a CheckpointWrapper (what FSDP's activation checkpointing adds): the final
    save and the step checkpoint both hold the trained adapter."""
    import transformers
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from hf_accel.training.trainer import Trainer

    model = dist_lora_save.build()
    layers = model.base_model.model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 96, (8, 12), generator=gen).tolist()]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=2, save_strategy="steps",
        save_steps=2, report_to="none", use_cpu=True, disable_tqdm=True, optim="sgd", learning_rate=0.5,
        lr_scheduler_type="constant", dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    trained = {n: t.clone() for n, t in lora_params(model).items()}
    assert_adapter_loads(tmp_path / "final", trained)
    assert_adapter_loads(tmp_path / "run" / "checkpoint-2", trained)


def test_empty_adapter_is_refused(tmp_path):
    """A state dict with no adapter tensor in it (e.g. a rank's, when only rank 0 holds the gathered one) raises
    and writes nothing, instead of a 40-byte adapter."""
    model = dist_lora_save.build()
    with pytest.raises(CheckpointError, match="no tensors"):
        adapters.save_adapter(model, str(tmp_path / "a"), {})
    base_only = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
    with pytest.raises(CheckpointError, match="no tensors"):
        adapters.save_adapter(model, str(tmp_path / "a"), base_only)
    assert not (tmp_path / "a").exists()


def test_share_tied_copies_only_aliases_equal_copies():
    """A gathered state dict's tied head points at the embedding when the values are equal; a head that differs (the
    tie broken in training) is kept as it is, and untied models' entries are never touched."""
    from hf_accel.training.checkpoint_hooks import share_tied_copies

    tied = dist_lora_save.build_tied()
    gathered = {k: v.clone() for k, v in tied.state_dict().items()}
    shared = share_tied_copies(tied, gathered)
    assert shared["lm_head.weight"] is shared["model.embed_tokens.weight"]
    assert gathered["lm_head.weight"] is not gathered["model.embed_tokens.weight"]  # the caller's dict is not changed
    gathered["lm_head.weight"][0, 0] += 1.0
    assert share_tied_copies(tied, gathered)["lm_head.weight"] is gathered["lm_head.weight"]
    untied = dist_lora_save.tiny_models.make("llama-gqa")
    state = {k: v.clone() for k, v in untied.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # equal values, but not tied in the model
    assert share_tied_copies(untied, state)["lm_head.weight"] is state["lm_head.weight"]
