"""The run, in layers, lowest first: config/ (the config file and its checks), world/ (the process group a
rank joins), engine/ (DeepSpeed's engine as fathom drives it), parts/ (the model's layers in pipeline form),
reports/ (metrics, memory, time), checkpoint/ (saving and resuming), safety/ (watchdog, signals,
non-finite losses), launch/ (the command that checks a run and starts it). Each imports only those before
it. At the top, what composes them on every rank: training (train, loop), validation, pipeline decoding and
the patches installed into the engine (docs/DESIGN.md draws it; tests/test_imports.py holds it)."""
