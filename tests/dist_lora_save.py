"""One process of a 2-process FSDP2 LoRA run on CPU (gloo), launched through torchrun by tests/test_lora_save.py.

What ``accelerate launch --config_file examples/accelerate/fsdp2{,_checkpointing}.yaml`` + the Trainer do with a PEFT
model, with accelerate's own functions (as tests/dist_fsdp.py; a real Accelerator is never FSDP on CPU): FSDP's
activation checkpointing (``fsdp2_apply_ac``: a ``CheckpointWrapper`` around each decoder layer) for layout "ac",
``fsdp2_prepare_model`` (one unit per decoder layer, the tail unit, the root), a few SGD steps, then the Trainer's final
save under FSDP2: accelerate's full state dict (``get_model_state_dict``: full, broadcast from rank 0, on CPU) on every
rank and ``_save`` of an hf_accel Trainer holding the model on rank 0 (transformers' ``save_model`` does exactly this;
the Trainer only saves here, the loop above is by hand). Output under --out: <layout>/adapter/ (layout "full":
<layout>/model/) and <layout>/trained.safetensors (every LoRA tensor after training, for "full" every parameter,
gathered from the shards, keyed by the unsharded model's parameter names).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_models  # noqa: E402
from multi_gpu_runs import accelerator_stand_in, leave_process_group  # noqa: E402

from hf_accel.training.adapters import plain_name  # noqa: E402

# layout: FSDP activation checkpointing (fsdp2_checkpointing.yaml / fsdp2.yaml); "full": a full fine-tune of a Llama
# with tied input and output embeddings under fsdp2.yaml (its save wrote the head twice on 2 GPUs)
LAYOUTS = {"ac": True, "plain": False, "full": False}
TARGETS = ["q_proj", "v_proj", "down_proj"]
STEPS = 2
LR = 0.5


def build_tied() -> torch.nn.Module:
    """Tiny Llama (seed 0) whose LM head is its input embedding (``tie_word_embeddings``), for a full fine-tune."""
    torch.manual_seed(0)
    model = tiny_models._llama(tie_word_embeddings=True)
    model.config.use_cache = False
    return model


def build() -> torch.nn.Module:
    """Tiny Llama (seed 0, tests/tiny_models.py) with LoRA; lora_B starts at zero, so a trained value shows."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = tiny_models.make("llama-gqa")
    model.config.use_cache = False
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))


def shard(model: torch.nn.Module, activation_checkpointing: bool) -> torch.nn.Module:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            reshard_after_forward=True, state_dict_type="FULL_STATE_DICT",
                                            activation_checkpointing=activation_checkpointing)
    accelerator = accelerator_stand_in(plugin, "no")
    plugin.set_auto_wrap_policy(model)  # accelerate's prepare: before AC and sharding
    if activation_checkpointing:
        model = fsdp2_apply_ac(accelerator, model)
    return fsdp2_prepare_model(accelerator, model)


def trainer_for(model: torch.nn.Module, out: Path):
    """An hf_accel Trainer holding ``model``; accelerate sets up the gloo process group (MULTI_CPU)."""
    import transformers

    from hf_accel.training.trainer import Trainer

    args = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, report_to="none", save_strategy="no",
                                          disable_tqdm=True)
    return Trainer(model=model, args=args)


def run_layout(layout: str, out: Path) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    full = layout == "full"
    trainer = trainer_for(build_tied() if full else build(), out / layout)
    rank = dist.get_rank()
    model = shard(trainer.model, LAYOUTS[layout])  # in place: the Trainer holds the sharded model
    assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2 left a parameter unsharded"
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        ids = torch.randint(3, tiny_models.VOCAB, (2, 24), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = {plain_name(n): p.full_tensor().detach().clone()  # a collective: every rank
               for n, p in model.named_parameters() if full or "lora_" in n}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)  # accelerate's
    state = get_model_state_dict(model, options=options)
    if rank == 0:
        (out / layout).mkdir(parents=True, exist_ok=True)
        save_file(trained, str(out / layout / "trained.safetensors"))
        trainer._save(str(out / layout / ("model" if full else "adapter")), state_dict=state)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    for layout in args.layouts.split(","):
        run_layout(layout, Path(args.out))
    leave_process_group()


if __name__ == "__main__":
    main()
