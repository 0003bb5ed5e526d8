"""DeepSpeed's pipeline engine as fathom runs it: every use of a DeepSpeed internal (internals), what fathom
installs into the engine (patches), activation recomputation with reseeded dropout (recompute), CUDA graphs
and Admin's profiling pass through the stages."""
