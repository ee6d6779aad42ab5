"""Benchmarks: quality, kernels, serving."""
