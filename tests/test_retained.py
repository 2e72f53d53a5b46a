"""tests/retained.py, the GPU suite's account of memory a test left behind, on CPU tensors: it names the groups of
shapes and the object that keeps the largest tensor alive, and passes over fake tensors of symbolic shape (which hold
no memory). Run in a fresh interpreter, where no other test's tensors are alive to outweigh these."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from retained import describe


class Keeper:  # stands for a trainer that outlives its run: its optimizer's moments in a list in a dict
    def __init__(self, model):
        self.state = {"moments": [torch.zeros(2000, 600)], "model": model}


kept = Keeper(nn.Linear(1000, 600))
# what dynamo leaves about in a suite's process: a fake tensor of symbolic shape, which holds no memory
symbolic = FakeTensorMode(shape_env=ShapeEnv()).from_tensor(
    torch.zeros(3, 4), symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 2))
print(describe("cpu"))
"""


def test_names_the_shapes_and_the_holder_of_what_is_left():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent)
    assert run.returncode == 0, run.stderr
    text = run.stdout
    assert "1 x (2000, 600) float32: 4.6 MiB" in text and "1 x (600, 1000) float32: 2.3 MiB" in text, text
    assert text.strip().splitlines()[-1].endswith("is held by: __main__.Keeper"), text  # through a list and a dict


FAILING_SUITE = """
import weakref

import torch

kept = []


def test_fails_holding_a_tensor():
    activations = torch.zeros(1000)
    kept.append(weakref.ref(activations))
    assert False


def test_finds_it_freed():
    assert kept[0]() is None, "the failed test's tensor outlived it"
"""


def test_a_failed_gpu_test_leaves_nothing_to_the_next(tmp_path):
    """tests/gpu/conftest.py frees what a failed test's frames hold (pytest keeps its traceback in
    sys.last_traceback): run 41's out-of-memory failure left 75.7 GiB to the next test, which then failed too."""
    gpu_conftest = Path(__file__).parent / "gpu" / "conftest.py"
    (tmp_path / "conftest.py").write_text(
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        f"spec = importlib.util.spec_from_file_location('gpu_conftest', {str(gpu_conftest)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "free_cuda_memory_between_tests = module.free_cuda_memory_between_tests\n")
    (tmp_path / "test_suite.py").write_text(FAILING_SUITE)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_suite.py"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert "1 failed, 1 passed" in run.stdout, run.stdout + run.stderr
    assert "test_suite.py::test_fails_holding_a_tensor" in run.stdout  # the first one fails; the second one passes
