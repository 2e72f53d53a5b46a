"""``hf-accel sft`` (hf_accel.cli.sft) for one process of a (multi-process) launch, writing to ``<--output-dir>/rank<RANK>``.

A folder per rank keeps each process's files apart (rank 0 writes metrics.json and the saved model, rank R
metrics.rank<R>.json). Each folder also gets ``logs.jsonl``: every log the Trainer made on that rank (the loss
and the throughput fields are global over ranks), for the per-step comparisons in docs/MULTI_GPU.md, and
``state.json``: the distributed type accelerate ran under (under DeepSpeed: the ZeRO stage and how many parameters
were partitioned) and how many matmuls the trimmed recompute skipped (memory.trim).
With ``HF_ACCEL_HANG_DUMP_S=N`` every thread's Python stack goes to stderr every N seconds (to see where a rank waits).
Used by tests/test_distributed.py and tests/test_zero3.py.
"""
import faulthandler
import json
import os
import sys

from hf_accel.cli import sft
from hf_accel.memory import trim
from hf_accel.training.trainer import AccelMixin


def _distributed_state(model) -> dict:
    """How accelerate ran this process (a launcher config that silently fell back to another type shows here), and
    how many of the model's parameters this rank held as a ZeRO-3 partition (smaller than the whole tensor)."""
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:  # sft.py built no Trainer
        return {"distributed_type": None}
    state = AcceleratorState()
    plugin = state.deepspeed_plugin
    params = list(model.parameters()) if model is not None else []
    partitioned = [p for p in params if hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel]
    return {"distributed_type": str(state.distributed_type.value), "num_processes": state.num_processes,
            "process_index": state.process_index, "device": str(state.device),
            "zero_stage": plugin.zero_stage if plugin is not None else None,
            "parameters": len(params), "zero3_partitioned": len(partitioned)}


def main(argv: list[str]) -> None:
    hang_dump_s = float(os.environ.get("HF_ACCEL_HANG_DUMP_S", 0))
    if hang_dump_s > 0:
        faulthandler.dump_traceback_later(hang_dump_s, repeat=True)
    at = argv.index("--output-dir") + 1
    argv[at] = os.path.join(argv[at], f"rank{os.environ.get('RANK', '0')}")
    os.makedirs(argv[at], exist_ok=True)
    records: list[dict] = []
    trained: list = []  # the Trainer's model, seen at its logs
    log = AccelMixin.log

    def recording_log(self, logs, *args, **kwargs):
        log(self, logs, *args, **kwargs)  # fills in this rank's throughput fields first
        trained[:] = [self.model]
        records.append({"step": self.state.global_step, **logs})

    AccelMixin.log = recording_log
    sft.main(argv)
    with open(os.path.join(argv[at], "logs.jsonl"), "w") as f:
        f.writelines(json.dumps(r, default=float) + "\n" for r in records)
    with open(os.path.join(argv[at], "state.json"), "w") as f:
        json.dump({**_distributed_state(trained[-1] if trained else None), "trim_skipped": trim.STATS.skipped}, f)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(sys.argv[1:])
