"""Profiler: measured per-layer shard times, memory and FLOPs, collectives, device microbenchmarks, calibration."""
