import gc
import sys
import traceback
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/tiny_models.py, tests/test_kernels.py


GIB = 1024**3
# What a test may leave allocated after it ends and the cleanup below ran: the workspaces libraries keep once created
# (cuBLAS, kernel caches) are small; a model or its activations still referenced are gigabytes.
RETAINED_LIMIT_GIB = 0.5
_start_allocated: list[int] = []  # bytes allocated before the first test of the process


def _free_failed_frames() -> None:
    """A failed test's locals (its models, optimizers, batches) outlive it in the traceback pytest keeps for
    post-mortem debugging (``sys.last_traceback``), and in the snapshots of them its report read: freed here, its
    report already written, so one failure does not run every later test of the process out of memory (run 41: 75.7
    GiB held after an out-of-memory failure, and the next test failed for it)."""
    tb = getattr(sys, "last_traceback", None)
    if tb is None:
        return
    traceback.clear_frames(tb)
    while tb is not None:
        try:
            tb.tb_frame.f_locals.clear()  # the dict pytest's report read (Python <= 3.12 keeps it on the frame)
        except (AttributeError, TypeError, RuntimeError):
            pass  # 3.13's write-through view: nothing cached to free
        tb = tb.tb_next


@pytest.fixture(autouse=True)
def free_cuda_memory_between_tests(request):
    """`pytest -m gpu tests/gpu` in one process (issue 18e): each test starts with the memory earlier tests held
    released (compiled graphs and their cached tensors, models in reference cycles, the allocator's cache), and a test
    that leaves more than RETAINED_LIMIT_GIB allocated after that fails at teardown, naming the amount. So a suite run
    in several processes (one device call cannot hold it all) still shows that no test passes on memory an earlier
    one would hold in a single process (2026-11-29: one process held 133 GiB before the last test and it ran out)."""
    cuda = torch.cuda.is_available()
    if cuda and not _start_allocated:
        _start_allocated.append(torch.cuda.memory_allocated())
    yield
    _free_failed_frames()
    torch._dynamo.reset()
    gc.collect()
    if not cuda:
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    retained = (torch.cuda.memory_allocated() - _start_allocated[0]) / GIB
    if retained > 0.01:
        sys.stderr.write(f"[retained {retained:.2f} GiB] {request.node.nodeid}\n")
    if retained > RETAINED_LIMIT_GIB:
        from retained import describe

        sys.stderr.write(describe("cuda") + "\n")  # which tensors, and who holds the largest
    assert retained <= RETAINED_LIMIT_GIB, (
        f"{retained:.2f} GiB of CUDA memory is still allocated after the test ended, gc ran and dynamo was reset: "
        f"something outlives the test (a module-level cache, a fixture, a global); in one process every later test "
        f"would run without it")


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
