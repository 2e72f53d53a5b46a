"""One process of a 2-process FSDP2 run over gloo (``torchrun --nproc_per_node 2``): what each rank really holds of
the training state against ``memory.estimate.sharded_state_bytes``, the share the checkpointing budget plans with.

A tiny Llama in bf16, full fine-tune or LoRA, sharded by accelerate's own ``fsdp2_prepare_model`` under bf16 mixed
precision (so the trainable parameters are upcast to fp32 master weights, as on the GPUs), one AdamW step; then each
rank sums the bytes of its local shards of parameters, gradients and optimizer states. Writes
``<out>/state.rank<R>.json``. Used by tests/test_memory.py.
"""
import argparse
import json
import os
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multi_gpu_runs import leave_process_group  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--lora", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    from hf_accel.data.default_task import tiny_llama
    from hf_accel.memory.estimate import Sharding, sharded_state_bytes, training_state_bytes

    model = tiny_llama(64, seed=0, hidden_size=64).to(torch.bfloat16)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    PartialState(cpu=True)  # accelerate's logging (its upcast notice) needs its state
    world = dist.get_world_size()
    shard, gathered = sharded_state_bytes(model, "adamw", True, Sharding("fsdp2", world, 4))
    unsharded = training_state_bytes(model, "adamw", True)  # what budgets planned with before
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            reshard_after_forward=True, state_dict_type="FULL_STATE_DICT")
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), mixed_precision="bf16",
                                        is_main_process=dist.get_rank() == 0, torch_device_mesh=None)
    model = fsdp2_prepare_model(accelerator, model)
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
    ids = torch.randint(3, 64, (1, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    held = {"params": sum(local(q) for q in model.parameters()),
            "grads": sum(local(q.grad) for q in model.parameters() if q.grad is not None),
            "optimizer": sum(local(v) for state in optimizer.state.values() for v in state.values()
                             if torch.is_tensor(v) and v.dim() > 0)}
    with open(os.path.join(args.out, f"state.rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"held": held, "estimated_shard": shard, "estimated_gathered": gathered,
                   "unsharded_estimate": unsharded}, f)
    leave_process_group()


if __name__ == "__main__":
    main()
