#!/usr/bin/env python
"""Packs the bench's kept-apart packages (Unsloth and its pins, bitsandbytes) into .gpu/apart, installed by a call
of its own between fetch-gpu-wheels.sh's two (`.gpu/b` + this + the repo is over the 64 MiB a call carries).

    python scripts/pack_apart.py            # here: download, slim, write .gpu/apart/install.sh (~17 MiB)
    # on the GPU machine, after the call carrying [".gpu/a"] and before the one carrying [".gpu/b"]:
    source .gpu/apart/install.sh            # carrying [".gpu/apart"]

install.sh installs bitsandbytes into /tmp/site-bnb and the rest into /tmp/site-unsloth, the folders the configs
that need them put first on their child's PYTHONPATH (scripts/benchlib/apart.py). The wheels are fetched without
dependencies (the GPU image has torch, transformers, peft, accelerate, numpy, requests, pillow, ...) and slimmed by
dropping members nothing here imports: Unsloth's `studio/` web app (26 of its 28 MB) and bitsandbytes' libraries
for other CUDA versions, ROCm and XPU (the image's torch is built for CUDA 13.0). Their RECORD lines go too.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGES = ("unsloth==2026.10.9", "unsloth-zoo==2026.10.9", "cut-cross-entropy==25.1.1", "trl==1.15.0",
            "datasets==4.8.5", "fsspec==2026.2.0", "torchao==0.18.0", "xformers==0.0.35", "bitsandbytes==0.50.2")
DROP = {"unsloth": r"^studio/", "bitsandbytes": r"libbitsandbytes_(cuda1[12]\d*|cuda13[1-9]|rocm|xpu)"}
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *[x for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                            "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any")
              for x in ("--platform", tag)]]
INSTALL = """# installs .gpu/apart (once per machine): bitsandbytes into /tmp/site-bnb, torchao (also) into
# /tmp/site-torchao, the rest into /tmp/site-unsloth
d=$(dirname "${BASH_SOURCE[0]}")
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$@"; }
if [ ! -f /tmp/site-bnb/.done ]; then pipi /tmp/site-bnb "$d"/bitsandbytes-*.whl && touch /tmp/site-bnb/.done || return 1; fi
if [ ! -f /tmp/site-torchao/.done ]; then pipi /tmp/site-torchao "$d"/torchao-*.whl && touch /tmp/site-torchao/.done || return 1; fi
if [ ! -f /tmp/site-unsloth/.done ]; then
  pipi /tmp/site-unsloth $(ls "$d"/*.whl | grep -v bitsandbytes) && touch /tmp/site-unsloth/.done || return 1
fi
"""


def slim(wheel: Path, pattern: str) -> None:
    """Rewrite ``wheel`` without the members matching ``pattern`` (and without their RECORD lines)."""
    drop = re.compile(pattern)
    slimmed = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if drop.search(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not drop.search(line.split(",")[0])]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(info, data)
    slimmed.replace(wheel)


# --bnb-only: bitsandbytes alone (~3.5 MiB), small enough to ride along with .gpu/b in the call that starts a queue
BNB_INSTALL = """# installs bitsandbytes into /tmp/site-bnb (once per machine); the jobs that need it put it first on their path
d=$(dirname "${BASH_SOURCE[0]}")
if [ ! -f /tmp/site-bnb/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-bnb \\
    "$d"/bitsandbytes-*.whl && touch /tmp/site-bnb/.done || return 1
fi
"""


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="default .gpu/apart (.gpu/bnb with --bnb-only)")
    p.add_argument("--bnb-only", action="store_true", help="bitsandbytes alone, installed by `source "
                   ".gpu/bnb/install.sh` in the call carrying .gpu/b")
    args = p.parse_args(argv)
    out = Path(args.out or (".gpu/bnb" if args.bnb_only else ".gpu/apart"))
    packages = [pkg for pkg in PACKAGES if pkg.startswith("bitsandbytes")] if args.bnb_only else PACKAGES
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(out),
                    *packages], check=True)
    for wheel in out.glob("*.whl"):
        name = wheel.name.split("-")[0].lower()
        if name in DROP:
            slim(wheel, DROP[name])
    (out / "install.sh").write_text(BNB_INSTALL if args.bnb_only else INSTALL)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"packed {len(list(out.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB into {out}")
    return out


if __name__ == "__main__":
    main()
