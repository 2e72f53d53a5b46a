import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/tiny_models.py, tests/test_kernels.py


@pytest.fixture(autouse=True)
def free_cuda_memory_between_tests():
    """`pytest -m gpu tests/gpu` in one process: each test starts with the memory earlier tests held released
    (compiled graphs and their cached tensors, models in reference cycles, the allocator's cache)."""
    yield
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def pytest_runtest_logreport(report):
    """A failure's traceback, and each test's time, written when it happens: a run cut by a device call's time limit
    still shows why each finished test failed and what took the time (pytest prints its summary and --durations only
    at the end; 2026-11-30 lost three failures and the one-process suite's durations that way)."""
    if report.when == "call" or (report.when == "setup" and report.duration > 1.0):
        sys.stderr.write(f"[{report.when} {report.duration:.1f}s {report.outcome}] {report.nodeid}\n")
        sys.stderr.flush()
    if report.failed:
        sys.stderr.write(f"\n[FAILED {report.when}] {report.nodeid}\n{report.longreprtext[-4000:]}\n")
        sys.stderr.flush()
