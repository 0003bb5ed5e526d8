"""Measuring: the memory planner, speed benchmarks against torchscale, and training comparisons."""
