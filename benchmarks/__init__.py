"""kubetune's benchmarks, each a module run from the repository root
(`python -m benchmarks.<name>`, its docstring says what it measures), its results dated under
benchmarks/results/. What they measure with (percentiles, counter deltas, the API server's
counters, /proc) is defined once, in `benchmarks.measure`."""
