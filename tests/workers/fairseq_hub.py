"""Run with the fairseq 0.12.2 environment's Python (scripts/setup_fairseq_env.sh), not ours.

Usage: fairseq_hub.py EXPORT_DIR INPUT.txt OUT.json
Loads an export as a fairseq user would, TransformerModel.from_pretrained(EXPORT_DIR), translates the raw
lines of INPUT.txt (beam 4, lenpen 0.6, at most 40 pieces) and writes {"translations": [...], "criterion":
the criterion section of the config fairseq loaded}.
"""

import json
import sys

from fairseq.models.transformer import TransformerModel
from omegaconf import OmegaConf

export, source, out = sys.argv[1:]
hub = TransformerModel.from_pretrained(export, checkpoint_file="checkpoint.pt")
lines = open(source, encoding="utf-8").read().split("\n")[:-1]
translations = hub.translate(lines, beam=4, lenpen=0.6, max_len_a=0, max_len_b=40)
criterion = OmegaConf.to_container(hub.cfg.criterion)
with open(out, "w", encoding="utf-8") as f:
    json.dump({"translations": translations, "criterion": criterion}, f)
