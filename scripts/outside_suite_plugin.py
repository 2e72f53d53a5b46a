"""pytest plugin: every transformers model a test builds is patched by hf_accel.patch() (``-p outside_suite_plugin``).

HF_ACCEL_OUTSIDE_PATCH=0 loads it without patching, for the stock run. HF_ACCEL_OUTSIDE_SEED=N seeds each test's
random inputs and weights from N and its id (transformers' ids_tensor draws from an unseeded ``random.Random``), so
the stock and the patched run of one seed see the same tensors and a difference between them is the patch's.

Used by scripts/outside_suite.py to run transformers' own model tests with hf_accel in the loop. It wraps
``PreTrainedModel.post_init`` (the last step of every model's ``__init__``, from a config or from_pretrained): the
model just built is patched when hf_accel has a family for it; a model built inside another (a CausalLM's body) is
unpatched again when the outer one is patched, so only the outermost model carries the patch; a model hf_accel builds
itself while patching (the fake-tensor copy hf_accel.facts probes) is left alone. Each attempt is
appended, one JSON object a line, to the file named by HF_ACCEL_PATCH_LOG (test id, class, patched or why not).
"""
from __future__ import annotations

import json
import os
import random
import sys
import zlib

import pytest

_current_test = {"id": None}
_patching = {"depth": 0}  # > 0 while hf_accel.patch runs: the models it builds itself (its probe copies) stay stock


def _record(entry: dict) -> None:
    path = os.environ.get("HF_ACCEL_PATCH_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps({"test": _current_test["id"], **entry}) + "\n")


def _patch_outermost(model) -> None:
    import hf_accel
    from hf_accel.errors import HFAccelError
    from hf_accel.patching import STATE_ATTR
    from transformers import PreTrainedModel

    for module in model.modules():  # an inner model patched by its own post_init a moment ago
        if module is not model and isinstance(module, PreTrainedModel) and STATE_ATTR in module.__dict__:
            hf_accel.unpatch(module)
    _patching["depth"] += 1
    try:
        report = hf_accel.patch(model)
    except HFAccelError as error:
        _record({"model": type(model).__name__, "patched": False, "why": f"{type(error).__name__}: {error}"})
        return
    finally:
        _patching["depth"] -= 1
    _record({"model": type(model).__name__, "patched": True, "modules": len(report.patched_modules),
             "backend": report.backend})


def pytest_configure(config):
    from transformers import PreTrainedModel

    if os.environ.get("HF_ACCEL_OUTSIDE_PATCH", "1") == "0":
        return

    stock_post_init = PreTrainedModel.post_init

    def post_init(self, *args, **kwargs):
        out = stock_post_init(self, *args, **kwargs)
        if not _patching["depth"]:
            _patch_outermost(self)
        return out

    PreTrainedModel.post_init = post_init


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _current_test["id"] = item.nodeid
    seed = os.environ.get("HF_ACCEL_OUTSIDE_SEED")
    if seed is not None:
        import torch

        seed = zlib.crc32(f"{seed}:{item.nodeid}".encode())
        random.seed(seed)
        torch.manual_seed(seed)
        for module in list(sys.modules.values()):  # the tests' own generator(s)
            rng = getattr(module, "global_rng", None)
            if isinstance(rng, random.Random):
                rng.seed(seed)
