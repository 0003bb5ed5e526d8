"""Run with the fairseq 0.12.2 environment's Python (scripts/setup_fairseq_env.sh), not ours.

Usage: fairseq_logprobs.py INPUTS.pt CHECKPOINT.pt OUT.pt [CHECKPOINT.pt OUT.pt ...]
Loads each checkpoint with fairseq's own loader (strict) and saves its decoder's log-probabilities
for the batch (src_tokens, prev_output_tokens) in INPUTS.pt.
"""

import sys

import torch
from fairseq import checkpoint_utils

src_tokens, prev_output_tokens = torch.load(sys.argv[1])
for checkpoint, out in zip(sys.argv[2::2], sys.argv[3::2], strict=True):
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([checkpoint], strict=True)
    model = models[0].eval()
    with torch.no_grad():
        net_output = model(src_tokens, src_tokens.ne(1).sum(1), prev_output_tokens)
        torch.save(model.get_normalized_probs(net_output, log_probs=True), out)
