"""Checkpoint content checksums (issue 68b): 4 KiB overwritten in place, without a change of size, is caught on
resume; the damaged checkpoint is set aside and named, and the run continues from the older one with the losses of
an uninterrupted run. Background saves carry the same checksums."""
from __future__ import annotations

import json
import logging
import os
import shutil
import zlib

import pytest

from hf_accel.training import checksums
from hf_accel.training.checkpoint_io import MANIFEST, verify_checkpoint
from tests.checkpoint_runs import LOSS_RTOL, accel, losses, trainer


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    t = trainer(out)
    t.train()
    return out, losses(t)


def overwrite_in_place(path, offset_from_end: int = 8192, size: int = 4096) -> None:
    """4 KiB of 0xFF written into the file's data, its size unchanged (what a bad disk block or a stray write does)."""
    before = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(before - offset_from_end)
        f.write(b"\xff" * size)
    assert os.path.getsize(path) == before


def test_block_checksums_are_zlib_crc32_of_each_block(tmp_path):
    data = os.urandom(10_000)
    (tmp_path / "f.bin").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    got = checksums.checksums(str(tmp_path), ["f.bin", "empty"], block_bytes=4096)
    want = [f"{zlib.crc32(data[i:i + 4096]):08x}" for i in range(0, len(data), 4096)]
    assert got == {"f.bin": want, "empty": [f"{zlib.crc32(b''):08x}"]}


def test_a_block_overwritten_in_place_is_named_with_its_byte_range(tmp_path):
    data = os.urandom(3 * 4096)
    (tmp_path / "f.bin").write_bytes(data)
    recorded = checksums.checksums(str(tmp_path), ["f.bin"], block_bytes=4096)
    assert checksums.mismatch(str(tmp_path), recorded, 4096) is None
    with open(tmp_path / "f.bin", "r+b") as f:
        f.seek(5000)
        f.write(bytes([data[5000] ^ 0xFF]))  # a byte unlike the one there (a zero byte was already there 1 run in 256)
    problem = checksums.mismatch(str(tmp_path), recorded, 4096)
    assert "f.bin: content changed since the save" in problem and "bytes 4096-8191" in problem


def test_the_manifest_records_a_checksum_of_every_file(finished):
    out, _ = finished
    manifest = json.loads((out / "checkpoint-4" / MANIFEST).read_text())
    assert set(manifest["checksums"]["files"]) == set(manifest["files"])
    assert manifest["checksums"]["algorithm"] == "crc32"


def test_in_place_damage_of_the_same_size_is_set_aside_and_the_older_checkpoint_resumes(tmp_path, finished, caplog):
    done, reference = finished
    out = tmp_path / "run"
    shutil.copytree(done, out)
    shutil.rmtree(out / "checkpoint-6")
    overwrite_in_place(out / "checkpoint-4" / "model.safetensors")
    assert "model.safetensors: content changed since the save" in (verify_checkpoint(str(out / "checkpoint-4"))
                                                                     or "")
    t = trainer(out)
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        t.train(resume_from_checkpoint=True)
    assert any("checkpoint-4 is damaged" in r.message and "model.safetensors" in r.message
               and "resuming from checkpoint-2" in r.message for r in caplog.records)
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "damaged-checkpoint-4"]
    assert losses(t) == pytest.approx(reference, rel=LOSS_RTOL)


def test_background_saves_carry_checksums_too(tmp_path):
    out = tmp_path / "run"
    trainer(out, accel=accel(async_save=True), max_steps=2).train()
    manifest = json.loads((out / "checkpoint-2" / MANIFEST).read_text())
    assert "model.safetensors" in manifest["checksums"]["files"]
    assert verify_checkpoint(str(out / "checkpoint-2")) is None
    overwrite_in_place(out / "checkpoint-2" / "optimizer.pt", offset_from_end=2 * 4096)
    assert "optimizer.pt: content changed" in (verify_checkpoint(str(out / "checkpoint-2")) or "")
