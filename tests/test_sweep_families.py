"""scripts/sweep_families.py: every causal LM transformers maps, built tiny, patched against unpatched."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import sweep_families  # noqa: E402


def test_verdicts_from_the_differences():
    ok = dict(full=0.0, packed_alone=1e-6, packed_stock=1e-6, stock_alone=1e-6, grad=0.0, scale=6.0)
    assert sweep_families.verdict(**ok) == "ok"
    assert sweep_families.verdict(**{**ok, "full": 3.0}) == "MISMATCH"  # EXAONE 4's global layers before the fix
    assert sweep_families.verdict(**{**ok, "grad": 0.5}) == "MISMATCH"
    # packed unlike each document alone, like stock, and stock mixes them: a bidirectional or position-less model
    assert sweep_families.verdict(**{**ok, "packed_alone": 0.6, "packed_stock": 1e-6, "stock_alone": 0.6}) \
        == "ok-as-stock"
    # packed like neither (BART before the fix)
    assert sweep_families.verdict(**{**ok, "packed_alone": 0.6, "packed_stock": 0.03, "stock_alone": 0.6}) \
        == "MISMATCH"


def test_the_tiny_config_keeps_each_layer_kind_and_drops_dropout():
    config = sweep_families.tiny_config("exaone4")
    assert config.hidden_size == 64 and config.num_hidden_layers == len(config.layer_types) >= 2
    assert set(config.layer_types) == {"sliding_attention", "full_attention"} and config.sliding_window == 8
    assert config.attention_dropout == 0.0


@pytest.mark.slow  # three model types, a child process each
def test_the_sweep_runs_each_type_apart_and_says_what_it_found(tmp_path):
    out = tmp_path / "sweep"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep_families.py"), "--out", str(out),
                           "--types", "llama,doge,no_such_type"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads((out / "sweep.json").read_text())
    assert records["llama"]["verdict"] == "ok" and records["llama"]["packed_alone"] < 1e-4, records["llama"]
    assert records["doge"]["verdict"] == "refused" and "builds a mask of its own" in records["doge"]["why"]
    assert records["no_such_type"]["verdict"] == "not built"
    assert "| `doge` | refused |" in (out / "sweep.md").read_text()
    again = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep_families.py"), "--out", str(out),
                            "--types", "llama"], capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "earlier run" in again.stderr  # never mixed with an earlier run's files
