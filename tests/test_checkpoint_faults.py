"""Damaged checkpoints and failed saves (issues 17.5, 21e, 21f).

A damaged newest checkpoint is named and skipped, and the run resumes from the newest complete one with the losses
of an uninterrupted run; a full disk fails the save with a typed error and keeps the previous checkpoint; a process
SIGKILLed during a background write leaves the last complete checkpoint loadable and resumable; an unsafe pickle is
never unpickled.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from hf_accel.errors import CheckpointError
from hf_accel.training import checksums
from hf_accel.training.checkpoint_io import STAGING_DIR, verify_checkpoint
from tests.checkpoint_runs import LOSS_RTOL, accel, losses, trainer
from tests.multi_gpu_runs import launch_killed_in_save

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """An uninterrupted run's folder (checkpoints 2, 4, 6) and its losses."""
    out = tmp_path_factory.mktemp("finished") / "run"
    t = trainer(out)
    t.train()
    return out, losses(t)


class Unsafe:
    def __reduce__(self):  # unpickling this would run code: create a marker file
        return (open, (os.environ["HF_ACCEL_TEST_MARKER"], "w"))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def damage(ckpt: Path, kind: str) -> str:
    """Damage ``ckpt`` the way issue 17.5 lists; return the file name the error must name."""
    if kind == "empty":
        shutil.rmtree(ckpt)
        ckpt.mkdir()
        return ckpt.name
    if kind == "unsafe_rng":  # same size is not required: content is what counts
        torch.save({"python": Unsafe()}, ckpt / "rng_state.pth")
        manifest = json.loads((ckpt / "hf_accel_manifest.json").read_text())
        manifest["files"]["rng_state.pth"] = (ckpt / "rng_state.pth").stat().st_size
        manifest["checksums"]["files"]["rng_state.pth"] = checksums.checksums(  # a manifest that agrees: the
            str(ckpt), ["rng_state.pth"], manifest["checksums"]["block_bytes"])["rng_state.pth"]  # parse must refuse
        (ckpt / "hf_accel_manifest.json").write_text(json.dumps(manifest))
        return "rng_state.pth"
    name = {"model": "model.safetensors", "optimizer": "optimizer.pt", "trainer_state": "trainer_state.json",
            "rng": "rng_state.pth"}[kind]
    if kind == "rng":
        (ckpt / name).write_bytes(os.urandom((ckpt / name).stat().st_size))  # garbage of the right size
    else:
        truncate(ckpt / name)
    return name


@pytest.mark.parametrize("kind", ["model", "optimizer", "trainer_state", "rng", "empty", "unsafe_rng"])
def test_damaged_newest_checkpoint_is_named_and_the_previous_one_resumes(tmp_path, finished, kind, caplog,
                                                                         monkeypatch):
    done, reference = finished
    out = tmp_path / "run"
    shutil.copytree(done, out)
    shutil.rmtree(out / "checkpoint-6")
    marker = tmp_path / "unpickled"
    monkeypatch.setenv("HF_ACCEL_TEST_MARKER", str(marker))
    bad = damage(out / "checkpoint-4", kind)
    assert bad in (verify_checkpoint(str(out / "checkpoint-4")) or "")
    t = trainer(out)
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        t.train(resume_from_checkpoint=True)
    assert any("checkpoint-4 is damaged" in r.message and bad in r.message for r in caplog.records)
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "damaged-checkpoint-4"]
    assert losses(t) == pytest.approx(reference, rel=LOSS_RTOL)
    assert not marker.exists()  # the unsafe pickle was never executed


def test_no_complete_checkpoint_stops_with_one_line(tmp_path, finished):
    out = tmp_path / "run"
    shutil.copytree(done := finished[0], out)
    for step in (2, 4, 6):
        truncate(out / f"checkpoint-{step}" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in .*checkpoint-6: .*model.safetensors"):
        trainer(out).train(resume_from_checkpoint=True)
    assert done.exists()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_fails_the_save_loudly_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, mode):
    out = tmp_path / "run"
    real_save = torch.save

    def full_disk(obj, f, *a, **kw):
        if "checkpoint-4" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", full_disk)
    t = trainer(out, accel=accel(async_save=mode == "async"))
    with pytest.raises(CheckpointError, match="saving checkpoint-4 .* the disk is full.*checkpoint-2\\) is untouched"):
        t.train()
    assert sorted(os.listdir(out)) == ["checkpoint-2"]  # no partial checkpoint-4, no staging leftovers
    assert verify_checkpoint(str(out / "checkpoint-2")) is None


KILLED_RUN = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from tests.checkpoint_runs import accel, trainer
    trainer({out!r}, accel=accel(async_save=True)).train()
""")


@pytest.mark.slow
def test_sigkill_during_a_background_write_leaves_the_last_checkpoint_resumable(tmp_path, finished):
    out = tmp_path / "run"
    launch_killed_in_save([sys.executable, "-c", KILLED_RUN.format(root=str(ROOT), out=str(out))], ROOT, 4, 240,
                          tmp_path / "run.log")
    assert sorted(os.listdir(out)) == [STAGING_DIR, "checkpoint-2"]  # the write of checkpoint-4 was cut
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "checkpoint-2")
    t = trainer(out)
    t.train(resume_from_checkpoint=True)
    assert losses(t) == pytest.approx(finished[1], rel=LOSS_RTOL)
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


def test_verify_flags_a_truncated_zip_and_a_bad_safetensors_header(tmp_path):
    torch.save({"x": torch.ones(1000)}, tmp_path / "optimizer.pt")
    assert zipfile.is_zipfile(tmp_path / "optimizer.pt")
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 7)
    problem = verify_checkpoint(str(tmp_path))
    assert problem and "model.safetensors" in problem and "header" in problem
    (tmp_path / "model.safetensors").unlink()
    truncate(tmp_path / "optimizer.pt")
    assert "optimizer.pt" in (verify_checkpoint(str(tmp_path)) or "")


class _EngineConfig:  # stands for the objects DeepSpeed pickles beside its tensors (its config, enums)
    stage = 3


def test_deepspeed_engine_files_get_structure_checks_only(tmp_path):
    """DeepSpeed writes its engine state (``global_stepN/*_optim_states.pt``) as full pickles and reads them back with
    its own loader. verify_checkpoint parsed them with weights_only=True, which refused every ZeRO checkpoint (resume
    failed with "no complete checkpoint"); now they get the size and zip checks, and a truncated one is still caught.
    The same pickle at the checkpoint's top level, where transformers' weights-only loaders read, is still refused."""
    engine = tmp_path / "global_step3"
    engine.mkdir()
    torch.save({"optimizer_state_dict": {"x": torch.ones(1000)}, "ds_config": _EngineConfig()},
               engine / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert verify_checkpoint(str(tmp_path)) is None
    truncate(engine / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert "optim_states.pt" in (verify_checkpoint(str(tmp_path)) or "")
    shutil.rmtree(engine)
    torch.save({"ds_config": _EngineConfig()}, tmp_path / "optimizer.pt")
    assert "unreadable" in (verify_checkpoint(str(tmp_path)) or "")
