"""Benchmarks of the whole stack as real processes, through gRPC: latency, throughput, goodput and
handoff, beside transformers serving the same model."""
