#!/usr/bin/env python
"""Run transformers' own model tests unpatched and with every model patched by hf_accel, and list the regressions
(tests that pass unpatched and fail patched).

    python scripts/outside_suite.py --tests TF_TESTS --families llama,gpt_neox
    python scripts/outside_suite.py --tests TF_TESTS --families llama -k static_cache --repeat 10

TF_TESTS is a folder holding transformers' ``tests/`` package (test_modeling_common.py, causal_lm_tester.py,
generation/test_utils.py, models/<family>/test_modeling_<family>.py, ...): the sdist ships the top-level files only,
the rest comes from the transformers repository at the installed version (pipeline and export mixins may be stubs). Each run is one pytest process per family
and mode in TF_TESTS (``-p no:cacheprovider``, offline hub); the patched one loads scripts/outside_suite_plugin.py,
which patches every model the tests build and logs what it patched to <out>/<family>-patch-log.jsonl. Arguments
after ``--`` go to pytest. Not part of hf_accel's test suite (it needs transformers' test files, their test-only
packages ``parameterized`` and ``httpx``, and ~2 minutes per family on a 2-core CPU machine).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
FAMILIES = ("llama", "falcon", "gpt_neox", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")


def outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed / failed / skipped, from pytest's junit xml."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        result[test_id] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds
                           else "passed")
    return result


def run_pytest(tests: Path, family: str, patched: bool, out: Path, run: int, args: argparse.Namespace) -> dict:
    mode = "patched" if patched else "stock"
    junit = out / f"{family}-{mode}-{run}.xml"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS=str(args.threads))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(SCRIPTS), env.get("PYTHONPATH", "")) if p)
    env.update(HF_ACCEL_OUTSIDE_PATCH="1" if patched else "0", HF_ACCEL_OUTSIDE_SEED=str(run))
    if patched:
        env["HF_ACCEL_PATCH_LOG"] = str(out / f"{family}-patch-log.jsonl")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "outside_suite_plugin",
           f"--junitxml={junit}",
           *sorted(str(p) for p in (tests / "tests" / "models" / family).glob("test_modeling_*.py"))]
    if args.k:
        cmd += ["-k", args.k]
    cmd += args.pytest_args
    with open(out / f"{family}-{mode}-{run}.log", "w") as log:
        subprocess.run(cmd, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    return outcomes(junit)


def check_checkout() -> None:
    """Warn when this checkout's hf_accel.patches is not what gets imported (an editable install of another checkout
    maps the subpackage to its own patches/ folder)."""
    sys.path.insert(0, str(REPO))
    import hf_accel.patches

    where = Path(hf_accel.patches.__file__).resolve().parent
    if where != (REPO / "patches").resolve():
        print(f"warning: hf_accel.patches imports from {where}, not this checkout's patches/", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=Path, required=True, help="folder holding transformers' tests/ package")
    parser.add_argument("--families", default=",".join(FAMILIES), help="tests/models/<family> folders to run")
    parser.add_argument("-k", default=None, help="pytest -k selection")
    parser.add_argument("--repeat", type=int, default=1, help="runs per mode (flaky tests: failures are counted)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the pytest processes")
    parser.add_argument("--out", type=Path, default=None, help="logs and junit files (default: a temp folder)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args()
    check_checkout()
    out = args.out or Path(tempfile.mkdtemp(prefix="outside-suite-"))
    out.mkdir(parents=True, exist_ok=True)
    regressions = []
    for family in args.families.split(","):
        results = {False: [], True: []}
        for patched in (False, True):
            for run in range(args.repeat):
                results[patched].append(run_pytest(args.tests.resolve(), family, patched, out, run, args))
        counts = {p: Counter(o for r in results[p] for o in r.values()) for p in results}
        print(f"{family}: stock {dict(counts[False])}, patched {dict(counts[True])} ({args.repeat} run(s) each)")
        for test_id in sorted(results[False][0]):
            stock_fails = sum(r.get(test_id) == "failed" for r in results[False])
            patched_fails = sum(r.get(test_id) == "failed" for r in results[True])
            if patched_fails > stock_fails:
                regressions.append(f"{test_id}: failed {patched_fails}/{args.repeat} patched, "
                                   f"{stock_fails}/{args.repeat} stock")
    print(f"regressions ({len(regressions)}):" if regressions else "regressions: none")
    for line in regressions:
        print(f"  {line}")
    print(f"logs: {out}")


if __name__ == "__main__":
    main()
