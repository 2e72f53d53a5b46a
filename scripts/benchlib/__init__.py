"""The benchmark harness: training-throughput helpers used by scripts/bench.py (workloads, configurations, named
presets, timing and reports) and scripts/bench_tables.py (benchmarks/index.json from the result files, the generated
tables and chart). It depends on the library, never the reverse: nothing in hf_accel/ imports it. The scripts in
scripts/ import it as ``benchlib`` (their folder is first on the path); the tests find it through setup.cfg's pytest
``pythonpath``."""
