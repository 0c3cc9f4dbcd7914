"""Benchmarks: every figure is measured in the run that prints it, ratios within one run."""
