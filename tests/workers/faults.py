"""Launched by tests/test_stability.py under `deepspeed --num_gpus 2`: training runs with a fault injected
into one layer at one step.

Usage: faults.py main FAULT [scripts/train.py arguments]      one run through scripts/train.py's main()
       faults.py cases CONFIG OUT_DIR CASE=FAULT,OVERRIDE,... ...   train() per case into OUT_DIR/CASE
FAULT is KIND:STEP:LAYER (LAYER a module name, e.g. decoder.layers.1); KIND is
  output    the layer's output becomes +inf at that step,
  gradient  the gradient of the layer's first parameter becomes NaN at that step (its output stays finite),
  logit     the layer's output gets a -inf column (for the output projection: the loss is infinite,
            every gradient finite).
"""

import math
import os
import sys
from pathlib import Path

import torch

from fathom.model.parts import module_names
from fathom.pipeline import train as training
from fathom.pipeline.config.run_data import resolve_run
from fathom.pipeline.engine.internals import stage_layers, stage_range
from fathom.pipeline.world.distributed import run_launched

build_engine = training.build_engine


def faulty_forward(forward, kind, now):
    def run(inputs):
        outputs = forward(inputs)
        if not now():
            return outputs
        x, *rest = outputs if isinstance(outputs, tuple) else (outputs,)
        if kind == "output":
            x = x + math.inf
        else:
            x = x.masked_fill(torch.arange(x.size(-1), device=x.device) == x.size(-1) - 1, -math.inf)
        return (x, *rest) if rest else x

    return run


def inject(fault):
    """Makes train()'s build_engine return engines carrying the fault."""
    kind, step, name = fault.split(":")

    def build_faulty_engine(cfg):
        engine = build_engine(cfg)
        pipe, layer = engine.module, module_names(cfg.model).index(name)
        if layer in stage_range(pipe):
            module = {index: func for _, index, func in stage_layers(pipe)}[layer]

            def now():
                return pipe.training and engine.global_steps + 1 == int(step)

            if kind == "gradient":
                next(module.parameters()).register_hook(lambda grad: grad * math.nan if now() else grad)
            else:
                module.forward = faulty_forward(module.forward, kind, now)
        return engine

    training.build_engine = build_faulty_engine


def cases(config_path, out, specs):
    world_size = int(os.environ["WORLD_SIZE"])  # set by the launcher
    for case in specs:
        name, _, spec = case.partition("=")
        fault, *overrides = spec.split(",")
        inject(fault)
        cfg, corpus = resolve_run(config_path, [f"train.save_dir={out / name}", *overrides], world_size=world_size)
        training.train(cfg, corpus, resume=False)


args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # added by the launcher
if args[0] == "main":
    inject(args[1])
    run_launched(lambda: training.main(args[2:]))
else:
    run_launched(lambda: cases(args[1], Path(args[2]), args[3:]))
