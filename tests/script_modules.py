"""The repository's scripts as modules for tests (scripts/ is not a package): imported once, then cached.

The harness package the scripts share, scripts/benchlib, imports directly (``from benchlib.workloads import ...``):
setup.cfg's pytest ``pythonpath`` puts scripts/ on the tests' path, as running a script puts it on the script's."""
import importlib
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script_module(name: str):
    """``scripts/<name>.py`` imported as module ``name`` (scripts/ on the path only while it imports)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPTS))
