"""Benchmark harness: engine vs transformers with rooflines (see benchmarks/README.md)."""
