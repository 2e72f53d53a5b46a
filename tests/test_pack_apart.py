"""scripts/pack_apart.py's wheel slimming: the dropped members and their RECORD lines go, everything else stays
byte for byte (the download itself needs the package index and is not run here)."""
from __future__ import annotations

import zipfile

from script_modules import script_module


def test_slim_drops_members_and_their_record_lines(tmp_path):
    pack = script_module("pack_apart")
    wheel = tmp_path / "unsloth-1.0-py3-none-any.whl"
    members = {"unsloth/__init__.py": b"x = 1\n", "studio/app.js": b"big", "studio/icons/icon.png": b"png",
               "unsloth-1.0.dist-info/METADATA": b"Name: unsloth\n"}
    record = "".join(f"{name},sha256=abc,{len(data)}\n" for name, data in members.items())
    record += "unsloth-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr("unsloth-1.0.dist-info/RECORD", record)
    pack.slim(wheel, pack.DROP["unsloth"])
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert names == {"unsloth/__init__.py", "unsloth-1.0.dist-info/METADATA", "unsloth-1.0.dist-info/RECORD"}
        assert z.read("unsloth/__init__.py") == b"x = 1\n"
        kept = z.read("unsloth-1.0.dist-info/RECORD").decode().splitlines()
    assert [line.split(",")[0] for line in kept] == ["unsloth/__init__.py", "unsloth-1.0.dist-info/METADATA",
                                                     "unsloth-1.0.dist-info/RECORD"]


def test_bitsandbytes_keeps_only_the_cuda_13_0_library():
    import re

    pack = script_module("pack_apart")
    drop = re.compile(pack.DROP["bitsandbytes"])
    libs = ["cpu", "cuda118", "cuda121", "cuda128", "cuda130", "cuda132", "rocm64", "xpu2026"]
    kept = [lib for lib in libs if not drop.search(f"bitsandbytes/libbitsandbytes_{lib}.so")]
    assert kept == ["cpu", "cuda130"]
