"""Benchmarks of the Islands training loop on CPU: `python -m benchmarks` (see docs/BENCHMARKS.md)."""
