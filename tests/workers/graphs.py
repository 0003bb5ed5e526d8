"""Launched by tests/test_cuda_graphs.py under `deepspeed --num_gpus 2`: scripts/train.py's main() with
train.cuda_graphs on CPU ranks, where each replay runs the layer eagerly into fixed buffers as a graph
writes its own (tests/workers/recorded.py): pipeline/engine/cuda_graphs.py across stages,
without a GPU.

Usage: graphs.py [scripts/train.py arguments]
"""

import sys

from recorded import PARAMETERS, eager_record  # beside this file

from fathom.pipeline import train as training
from fathom.pipeline.engine import cuda_graphs
from fathom.pipeline.launch import checks
from fathom.pipeline.world.distributed import run_launched

cuda_graphs.recordable = lambda tensor: True
cuda_graphs.record = eager_record
checks.check_cuda_graphs = lambda cfg: None  # it refuses a machine without CUDA
build_engine = training.build_engine


def build_recorded_engine(cfg):
    engine = build_engine(cfg)
    PARAMETERS.update({p.data_ptr(): p for p in engine.module.parameters()})
    return engine


training.build_engine = build_recorded_engine
args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # added by the launcher
run_launched(lambda: training.main(args))
