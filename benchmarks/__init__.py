"""Benchmarks for pallas_loop: `python -m benchmarks.run` (see README.md)."""
