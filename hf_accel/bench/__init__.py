"""Training-throughput benchmark helpers used by scripts/bench.py (workloads, FLOP/MFU accounting, configurations)."""
