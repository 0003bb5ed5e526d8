"""The run, grouped by when code runs: launch/ (starting a job), config/ (the config file and its checks),
parts/ (the model's layers in pipeline form), engine/ (DeepSpeed's engine as fathom drives it),
checkpoint/ (saving and resuming), safety/ (watchdog, signals, non-finite losses), reports/ (metrics,
memory, time). At the top, what composes them on every rank: training, validation and pipeline decoding.
No module of a subpackage imports these top-level modules."""
