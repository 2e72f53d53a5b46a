"""tests/retained.py, the GPU suite's account of memory a test left behind, on CPU tensors: it names the groups of
shapes and the object that keeps the largest tensor alive."""
from __future__ import annotations

import torch
from torch import nn

from retained import describe


class _Keeper:
    """Stands for a trainer that outlives its run: its optimizer's moments in a dict in a list."""

    def __init__(self, model: nn.Module) -> None:
        self.state = {"moments": [torch.zeros(4099, 4097)], "model": model}  # larger than any other test keeps


def test_names_the_shapes_and_the_holder_of_what_is_left():
    kept = _Keeper(nn.Linear(1000, 600))
    text = describe("cpu")
    assert "1 x (4099, 4097) float32: 64.1 MiB" in text and "1 x (600, 1000) float32: 2.3 MiB" in text, text
    assert text.splitlines()[-1].endswith("is held by: test_retained._Keeper"), text  # through a list and a dict
    del kept
