"""``scripts/sft.py`` for one process of a multi-process launch, writing to ``<--output-dir>/rank<RANK>``.

sft.py writes metrics.json on every rank; a folder per rank keeps two processes from writing the same file (rank 0
also holds the saved model). Used by tests/test_distributed.py.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import sft  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    at = argv.index("--output-dir") + 1
    argv[at] = os.path.join(argv[at], f"rank{os.environ.get('RANK', '0')}")
    os.makedirs(argv[at], exist_ok=True)
    sft.main(argv)
