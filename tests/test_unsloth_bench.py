"""Unsloth and QLoRA bench configs (issue 20) without Unsloth or bitsandbytes: they are skipped with a reason that says
what is not installed and where it was looked for; a pack's folder goes first on the child's PYTHONPATH (ahead of the
parent's path, so Unsloth's pinned trl / datasets shadow the newer ones) and the child records what it imported; the
Unsloth config calls FastLanguageModel as its notebooks do (checked against a stand-in module)."""
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchlib import apart, configs
from benchlib.apart import child_env
from benchlib.configs import CONFIGS, Options, missing_requirement
from benchlib.train import RunSettings, Timing
from benchlib.workloads import WORKLOADS, DataSpec
from script_modules import script_module

REPO = Path(__file__).resolve().parents[1]
# what Unsloth 2026.10.9 reads before any network call (unsloth/models/_utils.py: get_statistics, has_internet)
OFFLINE = ("UNSLOTH_DISABLE_STATISTICS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
APART = ("unsloth", "unsloth-qlora", "trl-qlora", "hf_accel-qlora")


def fake_pack(root: Path, name: str, packages: dict[str, str]) -> Path:
    """<root>/site-<name> holding `packages` (name -> version): a module and its dist-info, as pip --target writes."""
    site = root / f"site-{name}"
    for package, version in packages.items():
        (site / package).mkdir(parents=True)
        (site / package / "__init__.py").write_text(f"__version__ = {version!r}\n")
        info = site / f"{package}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    return site


@pytest.fixture
def without_apart_packages(monkeypatch):
    """This Python's path without the folders holding Unsloth or bitsandbytes (the dev install has bitsandbytes for
    the QLoRA CPU tests): what an environment without them looks like to the configs' checks."""
    hidden = [p for p in sys.path if any((Path(p) / m).exists() for m in apart.APART_PACKAGES.values())]
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in hidden])


@pytest.mark.parametrize("name", APART)
@pytest.mark.usefixtures("without_apart_packages")
def test_apart_configs_say_what_is_not_installed_and_where_they_looked(name, tmp_path):
    reason = missing_requirement(CONFIGS[name], "cpu", "llama", Options(site_root=str(tmp_path)))
    module = "unsloth" if name.startswith("unsloth") else "bitsandbytes"
    assert reason.startswith(f"{module} not installed") and str(tmp_path / "site-") in reason, reason


@pytest.mark.usefixtures("without_apart_packages")
def test_a_pack_folder_makes_the_config_available(tmp_path, monkeypatch):
    monkeypatch.setitem(configs.REQUIREMENTS, "cuda", lambda device, fam: None)  # no GPU here
    options = Options(site_root=str(tmp_path))
    assert "not installed" in missing_requirement(CONFIGS["unsloth"], "cuda", "llama", options)
    fake_pack(tmp_path, "unsloth", {"unsloth": "2026.10.9"})
    assert missing_requirement(CONFIGS["unsloth"], "cuda", "llama", options) is None
    for family in ("qwen3", "mistral", "gemma2"):  # the issue-36 workloads' families
        assert missing_requirement(CONFIGS["unsloth"], "cuda", family, options) is None
    assert "Unsloth configs run" in missing_requirement(CONFIGS["unsloth"], "cuda", "falcon", options)
    assert "workloads only" in missing_requirement(CONFIGS["unsloth"], "cuda", "gpt_neox", options)
    assert "bitsandbytes not installed" in missing_requirement(CONFIGS["unsloth-qlora"], "cuda", "llama", options)


def test_child_path_puts_the_packs_first_and_they_shadow_installed_packages(tmp_path):
    import trl  # installed in the main environment; the pack's older pin must win in the child

    fake_pack(tmp_path, "unsloth", {"trl": "1.15.0"})
    fake_pack(tmp_path, "bnb", {"bitsandbytes": "0.50.2"})
    options = Options(site_root=str(tmp_path), extra_sites=("extra",))
    env = child_env(CONFIGS["unsloth"], options, base={"PYTHONPATH": "/parent/path", "PATH": os.environ["PATH"]})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "site-unsloth"), str(tmp_path / "site-bnb"),
                                                   str(tmp_path / "site-extra"), "/parent/path"]
    out = subprocess.run([sys.executable, "-c", "import trl, bitsandbytes; print(trl.__version__, trl.__file__)"],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "1.15.0" != trl.__version__ and out[1].startswith(str(tmp_path / "site-unsloth"))
    # configs that need no pack keep the parent's environment exactly
    assert child_env(CONFIGS["hf_accel-defaults"], Options(), base={"PYTHONPATH": "/p"}) == {"PYTHONPATH": "/p"}


def _run_bench(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--device", "cpu", "--tiny",
                    "--out", str(tmp_path / "out"), *args], env=env, capture_output=True, text=True, timeout=600,
                   check=True)
    return json.loads(next((tmp_path / "out").glob("*.json")).read_text())


@pytest.mark.slow
def test_bench_rows_say_not_installed_and_default_configs_leave_them_out(tmp_path):
    record = _run_bench(tmp_path, "--workload", "llama-8b-qlora", "--configs", ",".join(APART),
                        "--site-root", str(tmp_path))
    statuses = {r["config"]: r["status"] for r in record["results"]}
    assert statuses.keys() == set(APART)
    import importlib.util

    bnb_here = importlib.util.find_spec("bitsandbytes") is not None  # the dev install has it: TRL's row then stops
    for name, status in statuses.items():                             # at CUDA, hf_accel's runs on the CPU backend
        if bnb_here and name == "hf_accel-qlora":
            assert status == "ok", statuses
            continue
        assert status.startswith("skipped: "), statuses
        assert ("needs CUDA" if bnb_here and not name.startswith("unsloth") else "not installed") in status, statuses
    bench = script_module("bench")
    assert not set(APART) & set(bench.parse_args([]).configs)  # run only when named (or by a preset)


@pytest.mark.slow
def test_child_records_the_versions_it_imported_from_a_pack(tmp_path):
    site = fake_pack(tmp_path, "probe", {"unsloth": "9.9.9"})
    record = _run_bench(tmp_path, "--configs", "hf-sdpa-padded", "--steps", "1", "--extra-site", str(site))
    result = record["results"][0]
    assert result["status"] == "ok", result
    assert result["versions"]["unsloth"] == "9.9.9" and record["versions"]["unsloth"] is None  # the child's, not ours


def test_unsloth_config_calls_fastlanguagemodel_offline_as_its_notebooks_do(monkeypatch):
    calls = {}

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(**kwargs):
            calls["env"] = {k: os.environ.get(k) for k in OFFLINE}
            calls["compile_off"] = os.environ.get("UNSLOTH_COMPILE_DISABLE")
            calls["cache"] = os.environ.get("UNSLOTH_COMPILE_LOCATION")
            calls["load"] = kwargs
            return "model", "tokenizer"

        @staticmethod
        def get_peft_model(model, **kwargs):
            calls["lora"] = kwargs
            return "peft-model"

    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=FastLanguageModel))
    for key in (*apart.UNSLOTH_ENV, "UNSLOTH_COMPILE_LOCATION", "UNSLOTH_COMPILE_DISABLE"):
        monkeypatch.setenv(key, "")  # recorded, so what the runner sets is undone after the test
        monkeypatch.delenv(key)
    monkeypatch.setattr(apart, "saved_random_model", lambda settings: _folder("/model"))
    monkeypatch.setattr(apart, "run_trl", lambda model, data, settings, timing, **kw: calls.update(trl=(model, kw)))
    data = types.SimpleNamespace(spec=DataSpec.tiny())
    for workload in ("llama-8b-lora", "llama-1b", "gemma2-9b-lora"):  # the issue-36 families load the same way
        settings = RunSettings(WORKLOADS[workload], "cuda", True, steps=1, warmup=1, step_time_budget=1.0)
        calls.clear()
        CONFIGS["unsloth"].run(settings, data, Options(), Timing())
        assert calls["env"] == dict.fromkeys(OFFLINE, "1")  # set before Unsloth's import: no statistics, no hub
        assert os.path.isabs(calls["cache"]) and not calls["cache"].startswith(str(REPO))  # not in the checkout
        load = calls["load"]
        assert load["model_name"] == "/model" and load["max_seq_length"] == DataSpec.tiny().max_len
        assert load["load_in_4bit"] is False and load["full_finetuning"] is (workload == "llama-1b")
        if WORKLOADS[workload].lora:
            assert load["use_gradient_checkpointing"] == "unsloth" == calls["lora"]["use_gradient_checkpointing"]
            assert calls["lora"]["r"] == 16 and calls["lora"]["lora_alpha"] == 32
            assert set(calls["lora"]["target_modules"]) == set(WORKLOADS[workload].lora_targets)
            assert calls["trl"][0] == "peft-model"
        else:
            assert "lora" not in calls and load["use_gradient_checkpointing"] is False and calls["trl"][0] == "model"
        # TRL's own checkpointing stays off (Unsloth's is on the model); Unsloth's tokenizer is the processing class
        assert calls["trl"][1] == {"liger": False, "sft_overrides": {"gradient_checkpointing": False},
                                   "processing_class": "tokenizer"}
        assert calls["compile_off"] is None  # Unsloth's compiled modules stay on in its own row
    # unsloth-eager: the same call with Unsloth's compile switch off before its import (Gemma 2 on torch 2.11)
    calls.clear()
    timing = Timing()
    CONFIGS["unsloth-eager"].run(settings, data, Options(), timing)
    assert calls["compile_off"] == "1" and calls["load"]["load_in_4bit"] is False and calls["trl"][0] == "peft-model"
    assert "UNSLOTH_COMPILE_DISABLE=1" in timing.notes[0]


def test_qlora_needs_a_lora_workload():
    settings = RunSettings(WORKLOADS["llama-1b"], "cuda", True, steps=1, warmup=1, step_time_budget=1.0)
    with pytest.raises(ValueError, match="has no LoRA"):
        apart.qlora_base(settings, "sdpa")


class _folder:
    def __init__(self, path):
        self.path = path

    def __enter__(self):
        return self.path

    def __exit__(self, *exc):
        return False


def test_tables_label_unsloth_rows_with_the_versions_their_child_imported():
    from benchlib import index, tables

    row = index._row({"config": "unsloth", "status": "ok", "tokens_per_s": 1.0,
                      "versions": {"unsloth": "2026.10.9", "trl": "1.15.0", "torch": "2.11.0", "peft": None}})
    assert row["role"] == "stock" and row["versions"] == {"unsloth": "2026.10.9", "trl": "1.15.0"}
    assert tables._label(row) == "Unsloth FastLanguageModel + TRL padding-free (unsloth 2026.10.9, trl 1.15.0)"
    assert index.role("hf_accel-qlora") == "defaults"  # the QLoRA preset's "hf_accel defaults" line


def test_saved_random_model_reloads_as_the_workload_with_its_tokenizer_and_is_removed():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = RunSettings(WORKLOADS["llama-8b-qlora"], "cpu", True, steps=1, warmup=1, step_time_budget=1.0)
    with apart.saved_random_model(settings) as folder:
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert AutoTokenizer.from_pretrained(folder).pad_token_id == 0
    torch.manual_seed(settings.seed)
    built = configs.build_model(settings, "sdpa")  # the same seed: the same random weights
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), built.state_dict().values()))
    assert not os.path.exists(folder)
