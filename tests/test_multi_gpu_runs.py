"""tests/gpu/test_multi_gpu.py's plan, on CPU: both runs of a case see the same global batches with every speed-up
left on, and the loss and saved-weight comparisons pass and fail where they should."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multi_gpu_runs import (CASES, CONFIGS, STEPS, ZERO3_CASES, assert_loaded_equals_saved,  # noqa: E402
                            assert_loss_fell, assert_same_losses, case_args, launch_command, saved_tensors)


def test_case_commands_keep_the_defaults_and_equal_global_batches(tmp_path):
    """Both runs of a case: same config, data, budget, seed and steps; W x grad-accum equal; no speed-up turned off."""
    case = CASES["neox-lora"]
    two = launch_command(case.config, 2, case_args(case, tmp_path / "d.jsonl", tmp_path / "o", 1))
    one = launch_command(case.config, 1, case_args(case, tmp_path / "d.jsonl", tmp_path / "o", 2))

    def value(cmd: list[str], flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert int(value(two, "--num_processes")) * int(value(two, "--grad-accum")) == \
        int(value(one, "--num_processes")) * int(value(one, "--grad-accum")) == 2
    for flag in ("--config_file", "--model-shape", "--dataset", "--max-tokens-per-batch", "--seed", "--max-steps",
                 "--lr", "--lora-r", "--checkpointing", "--logging-steps"):
        assert value(two, flag) == value(one, flag), flag
    assert not [a for a in two if a.startswith("--no-")] and "--bf16" in two
    assert all((CONFIGS / c.config).is_file() for c in [*CASES.values(), *ZERO3_CASES.values()])
    assert value(two, "--output-dir") == value(one, "--output-dir")  # the test gives each its own; here both "o"
    assert len(CASES) * 2 <= 12 and len(ZERO3_CASES) * 2 <= 8  # each launch costs ~30-60 s of GPU time


def test_loss_comparison_tolerances():
    base = [10.0 - 0.3 * i for i in range(STEPS)]
    assert_same_losses([x * (1 + 1e-3) for x in base], base)
    with pytest.raises(AssertionError, match="step 1"):
        assert_same_losses([base[0] * 1.01, *base[1:]], base)
    with pytest.raises(AssertionError):
        assert_same_losses([*base[:-1], base[-1] * 1.05], base)
    with pytest.raises(AssertionError, match="expected 20"):
        assert_same_losses(base[:-1], base[:-1])
    assert_loss_fell(base)
    with pytest.raises(AssertionError, match="did not go down"):
        assert_loss_fell(base[::-1])


def test_saved_files_are_read_and_compared(tmp_path):
    from safetensors.torch import save_file

    weights = {"a.weight": torch.randn(3, 2), "b.lora_B.weight": torch.zeros(2, 2)}
    save_file({"a.weight": weights["a.weight"]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b.lora_B.weight": weights["b.lora_B.weight"]}, tmp_path / "model-00002-of-00002.safetensors")
    saved = saved_tensors(tmp_path, lora=False)
    assert_loaded_equals_saved({k: v.clone() for k, v in weights.items()}, saved)
    assert_loaded_equals_saved({k: v.to(torch.bfloat16) for k, v in weights.items()}, saved)  # bf16 model
    with pytest.raises(AssertionError, match="a.weight"):
        assert_loaded_equals_saved({**weights, "a.weight": weights["a.weight"] + 1}, saved)
    with pytest.raises(AssertionError, match="not in the loaded"):
        assert_loaded_equals_saved({"a.weight": weights["a.weight"]}, saved)
    with pytest.raises(AssertionError, match="no saved weights"):
        saved_tensors(tmp_path, lora=True)


def test_full_model_reload_check_uses_the_checkpoint_names(tmp_path):
    """GPT-NeoX's head is ``embed_out.weight`` in the file and ``lm_head.weight`` in the module (ZeRO-3 run on the
    H200, 2026-11-30: a name-by-name check against the loaded state_dict failed for a correct save)."""
    from safetensors.torch import load_file, save_file
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from multi_gpu_runs import assert_full_model_reloads

    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, tie_word_embeddings=False))
    model.save_pretrained(tmp_path / "run")
    saved = saved_tensors(tmp_path / "run", lora=False)
    assert "embed_out.weight" in saved and "embed_out.weight" not in model.state_dict()
    assert_full_model_reloads(tmp_path / "run", tmp_path / "again")
    # a save that wrote the head under a name transformers does not map: missing and unexpected on reload
    (shard,) = (tmp_path / "run").glob("model*.safetensors")
    tensors = load_file(shard)
    tensors["head.weight"] = tensors.pop("embed_out.weight")
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(AssertionError, match="head.weight"):
        assert_full_model_reloads(tmp_path / "run", tmp_path / "renamed")


# a launch stand-in: dies of SIGSEGV while a folder count (in the folder above its own) is under CRASHES, else exit CODE
CRASHING_LAUNCH = """
import ctypes, pathlib, sys
folder, crashes, code = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
tries = folder.parent / "tries"
count = int(tries.read_text()) + 1 if tries.exists() else 1
tries.write_text(str(count))
if count <= crashes:
    ctypes.string_at(0)  # SIGSEGV
(folder / "done").write_text(str(count))
sys.exit(code)
"""


@pytest.mark.parametrize("crashes, code, launches, passes", [(0, 0, 1, True), (1, 0, 2, True), (2, 0, 2, False),
                                                              (0, 1, 1, False), (1, 1, 2, False)])
def test_a_launch_that_dies_of_sigsegv_runs_once_more_in_a_new_folder(tmp_path, crashes, code, launches, passes):
    """launch_into_new_folder_or_fail: a SIGSEGV launches once more, in a new folder (the returned one holds that
    launch's files only); a second SIGSEGV or any other failure fails; no SIGSEGV, no second launch."""
    from multi_gpu_runs import died_of_sigsegv, launch_into_new_folder_or_fail

    made = []

    def new_folder() -> Path:
        made.append(tmp_path / f"run{len(made)}")
        made[-1].mkdir()
        return made[-1]

    def command(folder: Path) -> list[str]:
        return [sys.executable, "-c", CRASHING_LAUNCH, str(folder), str(crashes), str(code)]

    if passes:
        folder = launch_into_new_folder_or_fail(command, new_folder, timeout=60)
        assert folder == made[-1] and (folder / "done").read_text() == str(launches)
    else:
        with pytest.raises(pytest.fail.Exception, match=f"exited with {-11 if crashes >= 2 else code}"):
            launch_into_new_folder_or_fail(command, new_folder, timeout=60)
    assert len(made) == launches and not any((f / "done").exists() for f in made[:-1])
    assert died_of_sigsegv(1, "exitcode  : -11 (pid: 20276)  (SIGSEGV)") and not died_of_sigsegv(1, "exitcode: 1")


def test_a_failed_launch_shows_the_first_crash_not_faulthandlers_module_list():
    """CI's failure of 2026-12-07 showed only faulthandler's list of extension modules and the launcher's report: the
    6,000-character tail began after the crashing rank's "Fatal Python error". The excerpt leads with the crash."""
    from multi_gpu_runs import failure_tail

    crash = ["[rank1] step 6 saved", "terminate called without an active exception", "Fatal Python error: Aborted",
             "", "Current thread 0x00007f (most recent call first):", '  File "sft.py", line 12 in <module>']
    modules = "Extension modules: " + ", ".join(f"pkg{i}._ext" for i in range(900)) + " (total: 900)"
    launcher = [f"launcher line {i}" for i in range(80)]
    out = "\n".join(["training"] * 50 + crash + [modules] + launcher)
    text = failure_tail(out)
    assert "terminate called without an active exception" in text and 'File "sft.py", line 12' in text
    assert "Extension modules" not in text and text.rstrip().endswith("launcher line 79")
    assert failure_tail("\n".join(launcher)) == "\n".join(launcher)  # nothing crashed: the tail as it was
