"""Measuring fathom: speed benchmarks (against torchscale, fairseq), training comparisons, metric plots."""
