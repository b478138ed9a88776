"""The pytest-benchmark suite (``pytest benchmarks/ --benchmark-only``): each workload of
``paged-kv bench`` at small size, its baseline in the same group."""
