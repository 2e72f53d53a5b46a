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
