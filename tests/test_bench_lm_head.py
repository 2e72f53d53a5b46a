"""scripts/bench_lm_head.py on CPU (tiny shapes): every method runs, and the errors it reports are measured against
its live fp32 reference (a method that broke the loss would show here)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_lm_head.py"


@pytest.mark.slow
def test_lm_head_bench_reports_small_errors_for_every_method(tmp_path):
    out = tmp_path / "lm_head.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tokens", "300", "--hidden", "16", "--vocab", "700", "--device", "cpu",
         "--iters", "1", "--methods", "plain,liger,recompute,inline,inline:64", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=True,
    )
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["liger"]["status"].startswith("skipped")  # CPU: no liger kernel
    for name in ("plain", "recompute", "inline", "inline:64"):
        assert rows[name]["status"] == "ok" and rows[name]["ms"] > 0
        assert rows[name]["loss_abs_err"] < 1e-4
        assert rows[name]["grad_hidden_rel_err"] < 1e-5 and rows[name]["grad_weight_rel_err"] < 1e-5
    assert proc.stdout.strip().splitlines()[-1].startswith("| inline:64 |")


@pytest.mark.slow
def test_default_methods_include_cut_cross_entropy_and_skip_it_with_a_reason_on_cpu(tmp_path):
    out = tmp_path / "lm_head.json"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--tokens", "64", "--hidden", "8", "--vocab", "50", "--device", "cpu",
         "--iters", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert {"plain", "liger", "cce", "cce-nofilter", "inline"} <= set(rows)
    for name in ("cce", "cce-nofilter"):  # not installed here, and CPU: either reason, said plainly
        assert rows[name]["status"].startswith("skipped: cut-cross-entropy"), rows[name]
    assert rows["plain"]["status"] == "ok" and "cut-cross-entropy" in result["versions"]
