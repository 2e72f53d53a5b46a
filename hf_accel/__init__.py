"""hf_accel: fast, numerically equivalent fine-tuning for Hugging Face causal LMs.

Public API: ``patch`` / ``unpatch`` (the attention seam), ``list_backends``, the collators and samplers, checkpoint
policies, the Trainer classes and ``FlashMHA``. Names are imported on first use (PEP 562), so ``import hf_accel``
and the ``hf-accel`` command check their arguments before torch and transformers load; the supported transformers
range is checked at import all the same.
"""
from importlib import import_module as _import_module

from ._compat import check_transformers_version as _check_transformers_version
from .errors import (
    BackendUnavailable,
    CheckpointError,
    ConfigurationError,
    HFAccelError,
    InvalidBatch,
    UnsupportedModel,
    UnsupportedVersion,
)

_check_transformers_version()

__version__ = "0.1.0"

_LAZY = {  # public name -> module that defines it
    "format_backends": ".attention.kernels", "list_backends": ".attention.kernels",
    "PatchOptions": ".patch_options", "PatchReport": ".report", "patch": ".patching", "patch_report": ".patching", "unpatch": ".patching",
    "DataCollatorForPacking": ".data.collators", "DataCollatorForPadding": ".data.collators",
    "LengthGroupedBatchSampler": ".data.sampling", "TokenBudgetBatchSampler": ".data.sampling",
    "policy_from_spec": ".memory.checkpointing", "RunContext": ".memory.context",
    "FlashMHA": ".attention.flash_mha",
    "AccelArguments": ".training.trainer", "Trainer": ".training.trainer",
    "SFTTrainer": ".training.trl_trainer",  # TRL is optional: imported only when asked for
    "DPOTrainer": ".training.dpo", "GRPOTrainer": ".training.grpo", "KTOTrainer": ".training.kto",
    "RLOOTrainer": ".training.rloo",
    "text_model": ".multimodal",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(_import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'hf_accel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = sorted(["BackendUnavailable", "CheckpointError", "ConfigurationError", "HFAccelError", "InvalidBatch",
                  "UnsupportedModel", "UnsupportedVersion", *_LAZY])
