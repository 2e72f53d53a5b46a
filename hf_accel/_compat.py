"""Version gate: hf_accel supports transformers 5.17 through the latest 5.x; the names that differ across them; and
accelerate's launcher flags read as accelerate reads them.

The version is read from the installed package's metadata, so the check costs no import of transformers
(``import hf_accel`` and the ``hf-accel`` command stay light until something heavy is used).
"""
from __future__ import annotations

import os
from importlib import metadata

from packaging.version import Version

from .errors import UnsupportedVersion

TRANSFORMERS_MIN = Version("5.17.0")
TRANSFORMERS_MAX_EXCLUSIVE = Version("6.0.0")


def installed_transformers() -> str:
    """The installed transformers version (package metadata; the module's ``__version__`` without metadata)."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        import transformers

        return transformers.__version__


def check_transformers_version(version: str | None = None) -> None:
    """Raise UnsupportedVersion when transformers is outside [5.17, 6)."""
    found = Version(version or installed_transformers())
    if not TRANSFORMERS_MIN <= Version(found.base_version) < TRANSFORMERS_MAX_EXCLUSIVE:
        raise UnsupportedVersion(
            f"hf_accel supports transformers >=5.17,<6 but found {found}. "
            'Install a supported release, e.g. `pip install "transformers>=5.17,<6"`.'
        )


# A forward's KV-cache keyword: `cache=` from transformers 5.25 on (`past_key_values=` still accepted there),
# `past_key_values=` before it.
CACHE_KWARGS = ("cache", "past_key_values")


def cache_kwarg(kwargs: dict, default=None):
    """The KV cache a forward was given by keyword (the first of CACHE_KWARGS that is not None), else ``default``."""
    return next((kwargs[name] for name in CACHE_KWARGS if kwargs.get(name) is not None), default)


def launcher_flag(name: str) -> bool:
    """An environment flag that ``accelerate launch`` sets (ACCELERATE_USE_DEEPSPEED, ACCELERATE_USE_FSDP, ...), true
    for the spellings accelerate's own ``parse_flag_from_env`` takes (y, yes, t, true, on, 1; any case): read here
    without importing accelerate, which imports torch."""
    return os.environ.get(name, "").strip().lower() in ("y", "yes", "t", "true", "on", "1")
