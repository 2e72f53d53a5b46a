#!/usr/bin/env python
"""Benchmark results as data: rebuild benchmarks/index.json from benchmarks/results/*.json, then the generated tables
in BENCHMARKS.md, README.md and benchmarks/HISTORY.md (the regions between `<!-- bench:KIND ... -->` and
`<!-- /bench:KIND -->`).

    python scripts/bench_tables.py            # after adding result files: index + tables
    python scripts/bench_tables.py --check    # exit 1 if the index or a generated table is stale (CI)
    python scripts/bench_tables.py --chart    # also draw benchmarks/chart.png (needs matplotlib)

Never edit a generated table by hand: change the data (a new run) and regenerate. See scripts/benchlib/index.py for
which run is "current" per workload and scripts/benchlib/tables.py for the region kinds.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchlib.index import build_index, dumps  # noqa: E402
from benchlib.tables import StaleOrBroken, regenerate, write_chart  # noqa: E402

DOCUMENTS = ("BENCHMARKS.md", "README.md", "benchmarks/HISTORY.md")
INDEX = Path("benchmarks/index.json")
CHART = Path("benchmarks/chart.png")


def relative_links(text: str, document: str) -> str:
    """Generated regions link result files from the repository root (`](benchmarks/results/...)`); a document in a
    subfolder gets them relative to itself, so the links resolve where it lies."""
    depth = len(Path(document).parent.parts)
    if not depth:
        return text
    root = "../" * depth
    folder = Path(document).parent.as_posix() + "/"
    return text.replace("](benchmarks/", "](" + root + "benchmarks/").replace("](" + root + folder, "](")


def expected(root: Path) -> dict[Path, str]:
    """Every generated file's path (relative to root) and the text it should hold."""
    index = build_index(root / "benchmarks" / "results")
    out = {INDEX: dumps(index)}
    for name in DOCUMENTS:
        path = root / name
        if path.exists():
            out[Path(name)] = relative_links(regenerate(path.read_text(), index, name), name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a generated file is stale")
    p.add_argument("--chart", action="store_true", help=f"also write {CHART} (matplotlib)")
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        wanted = expected(args.root)
    except StaleOrBroken as exc:
        print(f"bench_tables: {exc}", file=sys.stderr)
        return 1
    stale = [rel for rel, text in wanted.items()
             if not (args.root / rel).exists() or (args.root / rel).read_text() != text]
    if args.check:
        if stale:
            print(f"bench_tables: stale: {', '.join(map(str, stale))}. Generated numbers come from "
                  "benchmarks/results/*.json: run `python scripts/bench_tables.py` (never edit them by hand).",
                  file=sys.stderr)
            return 1
        print("bench_tables: index and generated tables are up to date")
        return 0
    for rel in stale:
        (args.root / rel).write_text(wanted[rel])
        print(f"bench_tables: wrote {rel}")
    if args.chart:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("bench_tables: the chart needs matplotlib: pip install matplotlib",
                  file=sys.stderr)
            return 2
        import json

        write_chart(json.loads(wanted[INDEX]), args.root / CHART)
        print(f"bench_tables: wrote {CHART}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
