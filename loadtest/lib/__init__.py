"""What the load tools and benchmarks share (loadtest/README.md lists each module's job)."""
