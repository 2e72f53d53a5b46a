"""Shared test setup: offline hub, the gpu marker's skip, deterministic CPU math."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (README's `-n 2`) the workers share the machine's cores: each gets its share of threads, and so do
# the scripts and launches its tests start (they inherit OMP_NUM_THREADS), instead of every worker taking all cores.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pytest  # noqa: E402
import torch  # noqa: E402

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch before this file


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu tests/gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
