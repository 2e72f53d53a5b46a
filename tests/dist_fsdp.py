"""One process of a 2-process FSDP2 training run on CPU (gloo), launched through torchrun by tests/test_distributed.py.

accelerate runs FSDP only on GPUs (on CPU it falls back to DDP), so this does by hand what ``accelerate launch
--config_file examples/accelerate/fsdp2.yaml`` + the Trainer do, with their own functions where they exist:
- sharding: accelerate's ``fsdp2_prepare_model`` (one unit per decoder layer, the [final norm, (embeddings,) lm_head]
  tail unit, the root), or plain ``fully_shard`` with the LM head as its own unit resharded after forward (layout
  "head-unit": its weight is freed after the forward and gathered again for the backward);
- a step as transformers' Trainer does it: ``num_items_in_batch`` = the step's targets over every micro-batch and rank,
  each rank's loss times the world size (FSDP's reduce-scatter averages over ranks);
- the final save as the Trainer's ``save_model`` under FSDP2: accelerate's full state dict (torch DCP
  ``get_model_state_dict``, full, on CPU) on every rank, ``save_pretrained`` on rank 0, a barrier, then
  ``destroy_process_group`` on every rank. A rank that waits forever makes the launching test time out.

Rank 0 also trains the 1-process reference: a separately built, unsharded copy (same seed), grad-accum = world size,
over the same global micro-batches. Output under --out: <case>/{fsdp,reference}/ (save_pretrained),
<case>/grads-{fsdp,reference}.safetensors (full gradients after the first step's backward) and report.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_models  # noqa: E402
from multi_gpu_runs import accelerator_stand_in, leave_process_group  # noqa: E402

import hf_accel  # noqa: E402
from hf_accel.data.collators import DataCollatorForPacking  # noqa: E402
from hf_accel.fused.compiling import graphs_compiled  # noqa: E402
from hf_accel.fused.cross_entropy import bind_fused_loss  # noqa: E402

CASES = {  # name: (tiny model, extra config, sharding layout)
    "llama-tied": ("llama-gqa", {"tie_word_embeddings": True}, "accelerate"),
    "neox": ("neox-parallel", {}, "head-unit"),
    "falcon": ("falcon-40b-newarch", {}, "accelerate"),
    "llama-checkpointed": ("llama-gqa", {}, "accelerate"),
    "llama-compiled": ("llama-gqa", {}, "accelerate"),
}
# Cases whose sharded run compiles the decoder layers (the default tracing: nested graph breaks, aot_eager on CPU)
# with FSDP2's hooks inside the compiled call; the reference runs them eagerly.
COMPILED_CASES = ("llama-compiled",)
# Cases whose decoder layers are checkpointed (hf_accel's FullCheckpointing, every layer): the sharded run's recompute
# trimmed (memory.trim: the trained down_proj's matmul skipped, its weight gradient from the recomputed input), the
# reference's not, so the comparison holds the trim under FSDP2's gather / reshard and reduce-scatter.
CHECKPOINTED_CASES = ("llama-checkpointed",)
# The sharded run of these cases takes the collator's target rows (the fused loss computes the head on them only);
# the 1-process reference computes every row, so the comparison also holds the gathered path under FSDP2.
TARGET_ROWS_CASES = ("llama-tied", "neox")
STEPS = 3
CHUNK = 16  # tokens per fused-CE chunk: several chunks per micro-batch, as a real vocabulary gives
LR = 0.5  # plain SGD: a gradient that is off by any factor shows in the weights (Adam would normalise it away)


def build(name: str, overrides: dict, checkpointing: bool = False, trim: bool = True,
          compiled: bool = False) -> torch.nn.Module:
    from hf_accel.memory.checkpointing import FullCheckpointing

    torch.manual_seed(0)
    model = tiny_models.VARIANTS[name]()
    if overrides:
        config = model.config
        for key, value in overrides.items():
            setattr(config, key, value)
        torch.manual_seed(0)
        model = type(model)(config)
    model.config.use_cache = False
    model.float().train()
    hf_accel.patch(model, checkpointing=FullCheckpointing(trim_recompute=trim) if checkpointing else None,
                   compile={"backend": "aot_eager"} if compiled else False)
    bind_fused_loss(model, chunk_size=CHUNK)
    return model


def micro_batch(index: int, target_rows: bool = False) -> dict:
    """Global micro-batch `index`: 2-4 documents of 5-40 tokens packed into one row (the Trainer's collator)."""
    gen = torch.Generator().manual_seed(1000 + index)
    docs = []
    for _ in range(int(torch.randint(2, 5, (1,), generator=gen))):
        ids = torch.randint(3, tiny_models.VOCAB, (int(torch.randint(5, 41, (1,), generator=gen)),), generator=gen)
        labels = ids.clone()
        labels[: len(ids) // 3] = -100  # a prompt: no targets
        docs.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return DataCollatorForPacking(pad_token_id=0, target_rows=target_rows)(docs)


def targets(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())  # shifted: position t predicts label t+1


def shard(model: torch.nn.Module, layout: str) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    if layout == "accelerate":
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                reshard_after_forward=True, state_dict_type="FULL_STATE_DICT")
        return fsdp2_prepare_model(accelerator_stand_in(plugin), model)
    from hf_accel.memory.checkpointing import decoder_layers

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model.get_output_embeddings(), reshard_after_forward=True)
    fully_shard(model)
    return model


def step_loss(model, batches: list[dict], n_items: int, scale: int) -> float:
    total = 0.0
    for batch in batches:
        loss = model(**batch, num_items_in_batch=n_items).loss
        (loss * scale).backward()
        total += loss.item()
    return total


def full_grads(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in model.named_parameters()}


def head_calls(model) -> list[int]:
    calls = [0]
    model.get_output_embeddings().register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def loss_nodes(loss: torch.Tensor, depth: int = 4) -> list[str]:
    names, frontier = [], [loss.grad_fn]
    for _ in range(depth):
        frontier = [f for node in frontier if node is not None for f, _ in node.next_functions]
        names += [type(f).__name__ for f in frontier if f is not None]
    return names


def run_case(case: str, out: Path, rank: int, world: int) -> dict:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from hf_accel.memory import trim

    name, overrides, layout = CASES[case]
    compiled = case in COMPILED_CASES
    model = shard(build(name, overrides, checkpointing=case in CHECKPOINTED_CASES, compiled=compiled), layout)
    report = {"layout": layout, "sharded": all(isinstance(p, DTensor) for p in model.parameters())}
    patched = hf_accel.patch_report(model)
    report["compiled_layers"] = patched.compiled_layers
    report["nested_breaks"] = any("nested graph breaks" in note for note in patched.notes)
    graphs = graphs_compiled()
    skipped = trim.STATS.skipped
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    calls = head_calls(model)
    head_rows = []
    model.get_output_embeddings().register_forward_pre_hook(lambda m, args: head_rows.append(args[0].shape[0]))
    losses = []
    report["target_rows"] = case in TARGET_ROWS_CASES
    for step in range(STEPS):
        batches = [micro_batch(step * world + r, report["target_rows"]) for r in range(world)]
        n_items = sum(targets(b) for b in batches)
        if step == 0:  # one micro-batch's forward + backward, looked at closely
            out_0 = model(**batches[rank], num_items_in_batch=n_items)
            report["loss_nodes"] = loss_nodes(out_0.loss)
            report["head_calls_forward"] = calls[0]
            (out_0.loss * world).backward()
            report["head_calls_forward_backward"] = calls[0]
            report["head_rows"] = head_rows[-1]
            report["positions"], report["targets"] = batches[rank]["input_ids"].numel(), targets(batches[rank])
            local = out_0.loss.item()
            grads = full_grads(model)  # a collective: every rank
            if rank == 0:
                (out / case).mkdir(parents=True, exist_ok=True)
                save_file(grads, str(out / case / "grads-fsdp.safetensors"))
        else:
            local = step_loss(model, batches[rank:rank + 1], n_items, scale=world)
        optimizer.step()
        optimizer.zero_grad()
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item())
    report["losses"] = losses
    report["trim_skipped"] = trim.STATS.skipped - skipped
    report["graphs_compiled"] = graphs_compiled() - graphs
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)  # accelerate's
    state = get_model_state_dict(model, options=options)
    if rank == 0:
        model.save_pretrained(out / case / "fsdp", state_dict=state)
        report["reference_losses"] = train_reference(case, out, world)
    dist.barrier()
    return report


def train_reference(case: str, out: Path, world: int) -> list[float]:
    from safetensors.torch import save_file

    name, overrides, _ = CASES[case]
    model = build(name, overrides, checkpointing=case in CHECKPOINTED_CASES, trim=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        batches = [micro_batch(step * world + r) for r in range(world)]
        losses.append(step_loss(model, batches, sum(targets(b) for b in batches), scale=1))
        if step == 0:
            save_file(full_grads(model), str(out / case / "grads-reference.safetensors"))
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out / case / "reference")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    reports = {case: run_case(case, out, rank, world) for case in args.cases.split(",")}
    if rank == 0:
        (out / "report.json").write_text(json.dumps(reports, indent=2))
    leave_process_group()


if __name__ == "__main__":
    main()
