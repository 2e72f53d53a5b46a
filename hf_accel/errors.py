"""Every error hf_accel raises derives from HFAccelError, so callers can catch ours apart from torch's."""


class HFAccelError(Exception):
    """Base class of hf_accel's errors. Messages say what was received, what is allowed, and what to do."""


class UnsupportedModel(HFAccelError, TypeError):
    """The model's family (config.model_type) has no patch in hf_accel.patches."""


class BackendUnavailable(HFAccelError, RuntimeError):
    """No attention backend (or not the forced one) can serve a request; names the missing capability."""


class UnsupportedVersion(HFAccelError, ImportError):
    """An installed dependency is outside the range hf_accel supports."""


class InvalidBatch(HFAccelError, ValueError):
    """A batch or a dataset example is malformed (wrong dtype, ragged fields, empty document, ...)."""


class InvalidDataset(InvalidBatch):
    """A dataset has rows that cannot be trained on, found by checking it once before training
    (``hf_accel.data.validate``); ``report`` holds the count per kind and where the first ones are."""

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class ConfigurationError(HFAccelError, ValueError):
    """Options that contradict each other or the model (e.g. checkpointing on under FSDP's own)."""


class UsageError(ConfigurationError):
    """A command-line argument or config-file entry of the ``hf-accel`` command that cannot work; printed as one
    line naming the argument, what was wrong and what is allowed."""


class BudgetExceeded(ConfigurationError):
    """No checkpointing plan meets a memory budget for the micro-batch; raised before training. ``longest_tokens``:
    about the most tokens per micro-batch the budget holds (0: none); ``smallest_budget``: the smallest budget spec
    that fits this micro-batch (e.g. "budget:23.5GiB")."""

    def __init__(self, message: str, longest_tokens: int = 0, smallest_budget: str = "") -> None:
        super().__init__(message)
        self.longest_tokens, self.smallest_budget = longest_tokens, smallest_budget


class CheckpointError(HFAccelError, RuntimeError):
    """A checkpoint cannot be written or read back: a damaged or partial file (named), a full disk, or a checkpoint
    of another run or another base model."""


class NonFiniteLoss(HFAccelError, FloatingPointError):
    """Training met a non-finite loss, gradient norm or weight and stopped before saving anything of that step
    (``AccelArguments(non_finite="stop")``, the default). ``step``: the optimizer step where it first appeared;
    ``what``: "loss", "gradient norm" or "trainable weights"; ``checkpoint``: the newest checkpoint kept, or None."""

    def __init__(self, message: str, step: int = 0, what: str = "loss", value: float = float("nan"),
                 checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.step, self.what, self.value, self.checkpoint = step, what, value, checkpoint


def run_cli(main, argv: list[str] | None, prog: str) -> int:
    """Run a command's ``main(argv)``; hf_accel's own errors print as one line (no traceback): exit status 2 for an
    argument that cannot work (a ``UsageError``, as argparse's own), 1 for anything found later."""
    import sys

    try:
        main(argv)
    except HFAccelError as e:
        usage = isinstance(e, UsageError)
        print(f"{prog}: error: {e}" if usage else f"{prog}: error: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        return 2 if usage else 1
    return 0
