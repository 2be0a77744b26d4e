"""jaxpaged benchmarks (scripts, not installed). Run them from the repository root, e.g.
`python -m bench.throughput -h` or `python bench/throughput.py -h`."""
