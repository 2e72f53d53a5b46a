"""hf_accel: fast, numerically equivalent fine-tuning for Hugging Face Llama, Falcon and GPT-NeoX models.

Public API: ``patch`` / ``unpatch`` (the attention seam), ``list_backends``, the collators and samplers, checkpoint
policies, the Trainer classes (``SFTTrainer`` needs TRL and is imported on first use) and ``FlashMHA``.
"""
from ._compat import check_transformers_version as _check_transformers_version

_check_transformers_version()

from .errors import (  # noqa: E402
    BackendUnavailable,
    CheckpointError,
    ConfigurationError,
    HFAccelError,
    InvalidBatch,
    UnsupportedModel,
    UnsupportedVersion,
)
from .attention.kernels import format_backends, list_backends  # noqa: E402
from .patching import PatchReport, patch, patch_report, unpatch  # noqa: E402
from .data.collators import DataCollatorForPacking, DataCollatorForPadding  # noqa: E402
from .data.sampling import LengthGroupedBatchSampler, TokenBudgetBatchSampler  # noqa: E402
from .memory.checkpointing import policy_from_spec  # noqa: E402
from .attention.flash_mha import FlashMHA  # noqa: E402
from .training.trainer import AccelArguments, Trainer  # noqa: E402


def __getattr__(name: str):
    if name == "SFTTrainer":  # TRL is optional: imported only when asked for
        from .training.trainer import SFTTrainer

        return SFTTrainer
    raise AttributeError(f"module 'hf_accel' has no attribute {name!r}")

__version__ = "0.1.0"

__all__ = [
    "AccelArguments", "BackendUnavailable", "CheckpointError", "ConfigurationError", "DataCollatorForPacking", "DataCollatorForPadding",
    "FlashMHA", "HFAccelError", "InvalidBatch", "LengthGroupedBatchSampler", "PatchReport", "SFTTrainer",
    "TokenBudgetBatchSampler", "Trainer", "UnsupportedModel", "UnsupportedVersion", "format_backends",
    "list_backends", "patch", "patch_report", "policy_from_spec", "unpatch",
]
