"""What the load tools and benchmarks share: the Generate client, the workloads, percentiles,
reports and the MPS daemon."""
