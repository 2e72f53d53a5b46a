"""hf_accel: fast, numerically equivalent fine-tuning for Hugging Face Llama, Falcon and GPT-NeoX models.

Public API: ``patch`` / ``unpatch`` (the attention seam), ``list_backends``; the collators, samplers, checkpoint
policies, Trainer classes and FlashMHA live in their modules and are re-exported here as they are imported.
"""
from ._compat import check_transformers_version as _check_transformers_version

_check_transformers_version()

from .errors import (  # noqa: E402
    BackendUnavailable,
    ConfigurationError,
    HFAccelError,
    InvalidBatch,
    UnsupportedModel,
    UnsupportedVersion,
)
from .kernels import format_backends, list_backends  # noqa: E402
from .patching import PatchReport, patch, patch_report, unpatch  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable", "ConfigurationError", "HFAccelError", "InvalidBatch", "PatchReport", "UnsupportedModel",
    "UnsupportedVersion", "format_backends", "list_backends", "patch", "patch_report", "unpatch",
]
