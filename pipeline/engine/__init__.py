"""DeepSpeed's pipeline engine as fathom drives it: every use of a DeepSpeed internal (internals), activation
recomputation with reseeded dropout (recompute), CUDA graphs and Admin's profiling pass through the stages.
What fathom installs into a built engine composes these with the layers above (pipeline/patches.py)."""
