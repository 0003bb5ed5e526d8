"""Run with the fairseq 0.12.2 environment's Python (scripts/setup_fairseq_env.sh), not ours.

Usage: fairseq_config.py ARGS.json OUT.json [ARGS.json OUT.json ...]
fairseq's own config for a run given as flat arguments (ARGS.json: {name: value}), made as its loader makes
one for a checkpoint saved with `args` and as fairseq-train makes the one it saves: an argparse.Namespace
through convert_namespace_to_omegaconf, then OmegaConf.to_container(resolve=True, enum_to_str=True). The
model section, which stays the Namespace there (arch transformer has no dataclass), is written as a dict
after base_architecture, which the model builder runs on it, has added what it reads.

convert/fairseq_train_config.json, the sections an export starts from, is this worker's output for
{"task": "translation", "criterion": "label_smoothed_cross_entropy", "bpe": "sentencepiece"} and
to_fairseq.LINKED_DEFAULTS, its `model` section dropped.
"""

import argparse
import json
import sys

from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.models import ARCH_CONFIG_REGISTRY
from omegaconf import OmegaConf


def config(args: argparse.Namespace) -> dict:
    cfg = OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True)
    if isinstance(cfg["model"], argparse.Namespace):
        ARCH_CONFIG_REGISTRY[cfg["model"].arch](cfg["model"])
        cfg["model"] = vars(cfg["model"])
    return cfg


for args_file, out in zip(sys.argv[1::2], sys.argv[2::2], strict=True):
    with open(args_file, encoding="utf-8") as f:
        args = argparse.Namespace(**json.load(f))
    with open(out, "w", encoding="utf-8") as f:
        json.dump(config(args), f, indent=2)
        f.write("\n")
