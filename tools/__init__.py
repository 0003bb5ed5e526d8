"""Measuring: the memory planner, speed benchmarks against torchscale, the depth study and training comparisons."""
