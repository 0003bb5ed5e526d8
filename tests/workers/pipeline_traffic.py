"""Launched by tests/test_cluster_plan.py as one rank per stage: trains CONFIG while counting, step by
step, the bytes this rank's pipeline engine sends to other stages and the slots of its schedule, with and
without a forward or backward pass in them. Writes OUT/traffic-RANK.json.

Usage: pipeline_traffic.py CONFIG OUT [OVERRIDE ...]
"""

import json
import os
import sys
from collections import Counter
from pathlib import Path

from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from fathom.pipeline.config.run_data import resolve_run
from fathom.pipeline.train import train
from fathom.pipeline.world.distributed import run_launched

step = 0
sent, slots, busy = Counter(), Counter(), Counter()
deepspeed_send, deepspeed_steps, deepspeed_train_batch = (
    p2p.send,
    schedule.TrainSchedule.steps,
    PipelineEngine.train_batch,
)


def counting_send(tensor, dest_stage, async_op=False):
    sent[step] += tensor.numel() * tensor.element_size()
    return deepspeed_send(tensor, dest_stage, async_op=async_op)


def counting_steps(self):
    for commands in deepspeed_steps(self):
        slots[step] += 1
        busy[step] += any(isinstance(c, (schedule.ForwardPass, schedule.BackwardPass)) for c in commands)
        yield commands


def numbered_train_batch(self, *args, **kwargs):
    global step
    step = self.global_steps + 1
    return deepspeed_train_batch(self, *args, **kwargs)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # added by the launcher
    config_path, out = args[0], Path(args[1])
    p2p.send, schedule.TrainSchedule.steps, PipelineEngine.train_batch = (
        counting_send,
        counting_steps,
        numbered_train_batch,
    )
    world_size = int(os.environ["WORLD_SIZE"])
    cfg, corpus = resolve_run(config_path, [f"train.save_dir={out / 'run'}", *args[2:]], world_size=world_size)
    train(cfg, corpus, resume=False)
    record = {str(s): {"sent": sent[s], "slots": slots[s], "busy": busy[s]} for s in sorted(slots)}
    (out / f"traffic-{os.environ['RANK']}.json").write_text(json.dumps(record))


run_launched(main)
