"""Version gate: hf_accel supports transformers 5.17 through the latest 5.x."""
from __future__ import annotations

import transformers
from packaging.version import Version

from .errors import UnsupportedVersion

TRANSFORMERS_MIN = Version("5.17.0")
TRANSFORMERS_MAX_EXCLUSIVE = Version("6.0.0")


def check_transformers_version(version: str | None = None) -> None:
    """Raise UnsupportedVersion when transformers is outside [5.17, 6)."""
    found = Version(version or transformers.__version__)
    if not TRANSFORMERS_MIN <= Version(found.base_version) < TRANSFORMERS_MAX_EXCLUSIVE:
        raise UnsupportedVersion(
            f"hf_accel supports transformers >=5.17,<6 but found {found}. "
            'Install a supported release, e.g. `pip install "transformers>=5.17,<6"`.'
        )
