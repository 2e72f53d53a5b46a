"""Training-throughput benchmark helpers used by scripts/bench.py (workloads, FLOP/MFU accounting, configurations,
named presets) and scripts/bench_tables.py (benchmarks/index.json from the result files, the generated tables and
chart)."""
