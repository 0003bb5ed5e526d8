"""Run with the fairseq 0.12.2 environment's Python (scripts/setup_fairseq_env.sh), not ours.

Usage: fairseq_validate.py LABEL_SMOOTHING EXPORT_DIR OUT.json [EXPORT_DIR OUT.json ...]
fairseq-validate's computation on each export's valid split (written as raw text): its translation task
loads and batches the split, its label_smoothed_cross_entropy criterion scores each batch (valid_step)
and its reduce_metrics averages them; OUT.json gets `loss` and `nll_loss` in bits per target token,
unrounded (fairseq prints them rounded to 3 decimals), and `ntokens`. fairseq-validate itself takes the criterion from
the checkpoint's cfg, which fathom's exports do not hold, so here it comes from this command line.
"""

import json
import sys

import torch
from fairseq import checkpoint_utils, options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.logging import metrics


def validate(export: str, smoothing: str) -> dict:
    parser = options.get_validation_parser()
    args = options.parse_args_and_arch(
        parser,
        [export, "--path", f"{export}/checkpoint.pt", "--task", "translation", "--dataset-impl", "raw", "--cpu",
         "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", smoothing, "--valid-subset", "valid",
         "--max-tokens", "1000"],
    )  # fmt: skip
    cfg = convert_namespace_to_omegaconf(args)
    # fairseq-train saves sentence_avg false (a per-token loss) unless told --sentence-avg; this parser has
    # no optimization options, and without them the criterion's sentence_avg would come out true.
    cfg.criterion.sentence_avg = False
    task = tasks.setup_task(cfg.task)
    models, _ = checkpoint_utils.load_model_ensemble([cfg.common_eval.path], task=task, strict=True)
    model = models[0].eval()
    criterion = task.build_criterion(cfg.criterion).eval()
    task.load_dataset("valid", combine=False, epoch=1)
    batches = task.get_batch_iterator(
        dataset=task.dataset("valid"), max_tokens=cfg.dataset.max_tokens, seed=cfg.common.seed
    ).next_epoch_itr(shuffle=False)
    with torch.no_grad():
        log_outputs = [task.valid_step(sample, model, criterion)[2] for sample in batches]
    with metrics.aggregate() as aggregate:
        task.reduce_metrics(log_outputs, criterion)
        result = {key: float(aggregate[key].avg) for key in ("loss", "nll_loss")}
    return {**result, "ntokens": int(sum(log["ntokens"] for log in log_outputs))}


smoothing = sys.argv[1]
for export, out in zip(sys.argv[2::2], sys.argv[3::2], strict=True):
    with open(out, "w") as f:
        json.dump(validate(export, smoothing), f)
