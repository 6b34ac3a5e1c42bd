"""Micro-benchmarks of the engine's pieces in one process: decode step, prefill, kernels, KV formats,
KV transfer, and the SM split of two processes on one GPU."""
