"""Issue 69c's bench rows on the CPU (tiny shapes): hf_accel.SFTTrainer on a TRL anchor's own recipe (SFTConfig,
model, peft_config) trains the steps TRL's row of that recipe trains (same data, same init: the same losses), and its
presets name them. Liger's kernels need CUDA: on the CPU both rows of a Liger recipe run with use_liger_kernel off."""
from __future__ import annotations

import math

import pytest

import hf_accel

pytest.importorskip("trl", reason="needs trl (pip install 'hf_accel[trl]')")

from benchlib import configs  # noqa: E402
from benchlib.configs import CONFIGS, Options  # noqa: E402
from benchlib.presets import get_preset  # noqa: E402
from benchlib.train import RunSettings, Timing  # noqa: E402
from benchlib.workloads import WORKLOADS, DataSpec, build_config, make_data  # noqa: E402


def run(config: str, workload: str) -> tuple[Timing, object]:
    settings = RunSettings(WORKLOADS[workload], "cpu", True, steps=2, warmup=1, step_time_budget=60.0)
    data = make_data(DataSpec.tiny(), build_config(settings.workload, tiny=True).vocab_size, steps=3)
    timing = Timing()
    model = CONFIGS[config].run(settings, data, Options(substitute_attn="sdpa"), timing)
    return timing, model


@pytest.mark.parametrize("ours, theirs, workload", [
    ("hf_accel-trl", "trl-fa4-packed", "llama-1b"),
    ("hf_accel-trl", "trl-fa4-packed", "llama-8b-lora"),
    ("hf_accel-trl-liger", "trl-fa4-packed-liger", "llama-1b"),
])
def test_trl_route_rows_train_as_trls_own_rows(monkeypatch, ours, theirs, workload):
    run_trl = configs.run_trl
    liger = []
    monkeypatch.setattr(configs, "run_trl", lambda *a, liger_=None, **k: liger.append(k.pop("liger")) or
                        run_trl(*a, liger=False, **k))
    (ours_timing, ours_model), (theirs_timing, _) = run(ours, workload), run(theirs, workload)
    assert liger == [ours.endswith("liger")] * 2  # each row asked for its recipe's Liger setting
    assert len(ours_timing.losses) == len(theirs_timing.losses) == 2 and all(map(math.isfinite, ours_timing.losses))
    assert ours_timing.losses == pytest.approx(theirs_timing.losses, rel=1e-4)
    report = hf_accel.patch_report(ours_model)
    assert report is not None and report.patched_modules, report  # the drop-in row trained patched
    assert any(n.startswith(f"hf_accel.SFTTrainer on the recipe of anchor {theirs}") for n in ours_timing.notes)


def test_trl_route_presets_hold_the_drop_in_beside_the_defaults_and_trls_anchors():
    for name, anchors in (("trl-route-1b", {"trl-fa4-packed", "trl-fa4-packed-liger"}),
                          ("trl-route-8b-lora", {"trl-fa4-packed", "trl-fa4-packed-liger"}),
                          ("trl-route-8b-qlora", {"trl-qlora", "trl-qlora-noliger"})):
        preset = get_preset(name)
        assert anchors <= set(preset.configs) and set(preset.configs) <= set(CONFIGS)
        assert {"hf_accel-trl", "hf_accel-trl-liger"} <= set(preset.configs) or \
            {"hf_accel-qlora-sft", "hf_accel-qlora-sft-liger"} <= set(preset.configs)
