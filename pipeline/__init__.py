"""The run: its config, its checkpoint format, and the DeepSpeed glue that turns the layers of `model/`
into a PipelineModule and drives the engine (training, validation, pipeline-parallel decoding)."""
