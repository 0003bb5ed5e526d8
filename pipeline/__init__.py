"""DeepSpeed glue: turns the layers of `model/` into a PipelineModule and drives the engine."""
