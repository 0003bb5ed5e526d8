"""The run: its config (config/), its checkpoints (checkpoint/), what keeps it safe and observed (safety/),
and the DeepSpeed glue that turns the layers of `model/` into a PipelineModule and drives the engine
(training, validation, pipeline-parallel decoding)."""
