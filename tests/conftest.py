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


@pytest.fixture(autouse=True)
def _own_working_directory(tmp_path, monkeypatch):
    """Every test runs in its own empty folder: nothing depends on where pytest was started or on files an earlier
    run left there (e.g. the README's first command's runs/), and nothing a test writes lands in the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def one_torch_thread():
    """Tiny models on a shared 2-core machine run far faster on one thread; the test process's setting is put back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_dynamo():
    """No compiled graph or dynamo counter of an earlier test reaches this one (graph counts are assertions)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu tests/gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def deepspeed_cpu():
    """deepspeed (skips without it), with the one op its CPU backend JIT-compiles on every engine start (its
    shared-memory all-reduce) built here, before any timed launch. The first build of a fresh install took 3 minutes
    on a loaded 2-core machine (2026-12-01): inside a 2-rank ZeRO-3 launch it ran past that test's 150 s hang timeout;
    once built, a start loads it in about a second. Both xdist workers may call this; torch's build lock serialises
    them."""
    deepspeed = pytest.importorskip("deepspeed", reason="needs deepspeed (DS_BUILD_OPS=0 pip install deepspeed)")
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()
    return deepspeed
