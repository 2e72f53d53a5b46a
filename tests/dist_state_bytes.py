"""One process of a 2-process sharded run over gloo (``torchrun --nproc_per_node 2``): what each rank really holds of
the training state against ``memory.estimate.sharded_state_bytes``, the share the checkpointing budget plans with.

A tiny Llama in bf16, full fine-tune or LoRA, one AdamW step under bf16 mixed precision, sharded by
- ``--engine fsdp2``: accelerate's own ``fsdp2_prepare_model`` (the trainable parameters upcast to fp32 master
  weights, as on the GPUs); each rank sums the bytes of its local shards of parameters, gradients and optimizer
  states;
- ``--engine zero3``: ``deepspeed.initialize`` with examples/accelerate/ds_zero3.json, its "auto" sizes filled as
  transformers fills them; each rank sums every tensor storage alive after the step (DeepSpeed's partitions live in
  its own flat buffers: counting all of them needs no knowledge of its internals), which also counts its gradient
  bucket (``bucket_bytes``), the whole copies of parameters small enough to persist (``persistent_bytes``), both
  reported, and the batch.
Writes ``<out>/state.rank<R>.json``. Used by tests/test_memory.py.
"""
import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multi_gpu_runs import accelerator_stand_in, leave_process_group  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--engine", choices=["fsdp2", "zero3"], default="fsdp2")
    args = p.parse_args()
    dist.init_process_group("gloo")
    from hf_accel.data.default_task import tiny_llama
    from hf_accel.memory.estimate import Sharding, sharded_state_bytes, training_state_bytes

    model = tiny_llama(64, seed=0, hidden_size=64).to(torch.bfloat16)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    world = dist.get_world_size()
    shard, gathered = sharded_state_bytes(model, "adamw", True, Sharding(args.engine, world, 4, 2))  # as the Trainer
    unsharded = training_state_bytes(model, "adamw", True)  # what budgets planned with before
    ids = torch.randint(3, 64, (1, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    report = {"estimated_shard": shard, "estimated_gathered": gathered, "unsharded_estimate": unsharded}
    report.update(fsdp2_step(model, ids) if args.engine == "fsdp2" else zero3_step(model, ids))
    with open(os.path.join(args.out, f"state.rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    leave_process_group()


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def fsdp2_step(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    PartialState(cpu=True)  # accelerate's logging (its upcast notice) needs its state
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            reshard_after_forward=True, state_dict_type="FULL_STATE_DICT")
    plugin.set_mixed_precision("bf16")  # as Accelerator does: bf16 compute copies of the fp32 masters
    accelerator = accelerator_stand_in(plugin, "bf16")
    model = fsdp2_prepare_model(accelerator, model)
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return {"held": {"params": sum(local_bytes(q) for q in model.parameters()),
                     "grads": sum(local_bytes(q.grad) for q in model.parameters() if q.grad is not None),
                     "optimizer": sum(local_bytes(v) for state in optimizer.state.values() for v in state.values()
                                      if torch.is_tensor(v) and v.dim() > 0)}}


def zero3_step(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    import deepspeed

    config = json.loads((Path(__file__).resolve().parent.parent / "examples" / "accelerate" / "ds_zero3.json")
                        .read_text())
    hidden = model.config.hidden_size  # transformers' HfTrainerDeepSpeedConfig fills these "auto" sizes so
    config["zero_optimization"].update(reduce_bucket_size=hidden * hidden,
                                       stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
                                       stage3_param_persistence_threshold=10 * hidden)
    config.update(bf16={"enabled": True}, fp16={"enabled": False}, gradient_accumulation_steps=1,
                  gradient_clipping=1.0, train_micro_batch_size_per_gpu=1, train_batch_size=dist.get_world_size(),
                  zero_allow_untested_optimizer=True)
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    del loss
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    # parameters of at most stage3_param_persistence_threshold elements (norms, small LoRA matrices) also stay whole,
    # in bf16, on every rank (a few MB on an 8B model; not in the estimate)
    threshold = config["zero_optimization"]["stage3_param_persistence_threshold"]
    persistent = sum(q.ds_numel * 2 for q in engine.module.parameters() if q.ds_numel <= threshold)
    return {"held": {"all": sum(storages.values())}, "bucket_bytes": hidden * hidden * 2, "persistent_bytes": persistent}


if __name__ == "__main__":
    main()
