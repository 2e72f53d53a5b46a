"""One name per thing across the commands and their docs (issue 68e): estimate-memory's flags are sft's (the old
spellings still work), its MODEL takes every shape sft builds (llama-70b, gemma2-9b) as that same model, the guide
lists every --model-shape, the package description names no partial list of families; and the Python API trains on
the CPU with a core left free, as the command does."""
from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest
import torch

from hf_accel.cli import main

ROOT = Path(__file__).resolve().parent.parent
ESTIMATE_ONLY = {"--dtype", "--optimizer", "--device-gib", "--host-gib", "--loss", "--help", "-h"}


def option_strings(parser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def primary_options(parser) -> set[str]:
    return {action.option_strings[0] for action in parser._actions if action.option_strings}


def test_estimate_memory_names_its_flags_as_sft_does():
    from hf_accel.cli.args import _parser
    from hf_accel.cli.estimate import build_parser

    sft = option_strings(_parser(""))
    shared = primary_options(build_parser([])) - ESTIMATE_ONLY
    assert shared <= sft, sorted(shared - sft)


def test_old_and_new_spellings_and_every_shape_name_give_the_same_estimate(capsys):
    from hf_accel.cli.estimate import resolve_model
    from hf_accel.cli.shapes import BASES, model_shape_config, shape_config
    from hf_accel.memory.estimate import estimate_training_memory

    assert main(["estimate-memory", "qwen3-small", "--lora-r", "8", "--max-tokens-per-batch", "2048"]) == 0
    new = capsys.readouterr().out
    assert main(["estimate-memory", "qwen3-small", "--lora-rank", "8", "--batch-tokens", "2048"]) == 0
    assert capsys.readouterr().out == new
    want = estimate_training_memory(model_shape_config("qwen3-small"), lora_rank=8, batch_tokens=2048).table()
    assert new.strip() == want.strip()
    # sft's names are estimate-memory's: gemma2-9b (the published gemma-2-9b still works), the README's 70B shape
    assert resolve_model("gemma2-9b").to_dict() == model_shape_config("gemma2-9b").to_dict()
    assert resolve_model("llama-70b").to_dict() == shape_config(BASES["llama-70b"]).to_dict()
    assert resolve_model("gemma-2-9b") == "gemma-2-9b"
    assert main(["estimate-memory", "lama-8b"]) == 2
    assert "did you mean llama-8b?" in capsys.readouterr().err


def test_the_guide_lists_every_model_shape():
    from hf_accel.cli.args import MODEL_SHAPE_NAMES

    guide = (ROOT / "docs" / "guide" / "command-line.md").read_text()
    row = next(line for line in guide.splitlines() if line.startswith("| `--model-shape NAME`"))
    listed = set(re.findall(r"`([a-z0-9.\-]+)`", row))
    assert set(MODEL_SHAPE_NAMES) <= listed, sorted(set(MODEL_SHAPE_NAMES) - listed)


def test_the_package_description_names_no_partial_list_of_families():
    """hf_accel patches any causal LM whose attention goes through transformers' registry (and Falcon): a family
    named in the package's one-line description is a partial list (it named Llama, Falcon and GPT-NeoX)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    words = set(re.findall(r"[a-z0-9][a-z0-9-]*", config["metadata"]["description"].lower()))
    families = {t.replace("_", "-") for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES} | {"gpt-neox", "llama", "falcon"}
    assert not words & families, sorted(words & families)


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="one core: torch's default is one thread")
def test_the_trainer_trains_on_the_cpu_with_a_core_left_free(monkeypatch):
    import os

    import transformers

    from hf_accel.training.trainer import AccelArguments
    from tests.checkpoint_runs import trainer

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    cores = len(os.sched_getaffinity(0))
    seen = []

    class Threads(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    torch.set_num_threads(cores)  # torch's own default: one thread per core
    try:
        t = trainer("run", max_steps=2, save_strategy="no")
        t.add_callback(Threads())
        t.train()
        assert seen == [cores - 1] * 2 and torch.get_num_threads() == cores  # put back afterwards
        seen.clear()
        t = trainer("run2", max_steps=1, save_strategy="no",
                    accel=AccelArguments(backend="reference", print_summary=False, cpu_threads=None))
        t.add_callback(Threads())
        t.train()
        assert seen == [cores]  # None: torch's setting as it is
    finally:
        torch.set_num_threads(before)
