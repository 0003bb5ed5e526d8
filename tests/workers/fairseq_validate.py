"""Run with the fairseq 0.12.2 environment's Python (scripts/setup_fairseq_env.sh), not ours.

Usage: fairseq_validate.py EXPORT_DIR OUT.json [EXPORT_DIR OUT.json ...]
fairseq-validate's own computation (fairseq_cli/validate.py) on each export's valid split: the model, task
and criterion loaded from the export's checkpoint, the split batched by its task, each batch scored by
valid_step and averaged by reduce_metrics. OUT.json gets `loss` and `nll_loss` in bits per target token
unrounded (fairseq-validate prints them rounded to 3 decimals), and `ntokens`.
"""

import json
import sys

import torch
from fairseq import checkpoint_utils, options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.logging import metrics


def validate(export: str) -> dict:
    args = options.parse_args_and_arch(
        options.get_validation_parser(),
        [export, "--path", f"{export}/checkpoint.pt", "--task", "translation", "--cpu", "--max-tokens", "1000"],
    )
    cfg = convert_namespace_to_omegaconf(args)
    [model], saved_cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [cfg.common_eval.path], arg_overrides={"data": export}
    )
    criterion = task.build_criterion(saved_cfg.criterion).eval()  # the run's, as the export recorded it
    task.load_dataset("valid", combine=False, epoch=1, task_cfg=saved_cfg.task)
    batches = task.get_batch_iterator(
        dataset=task.dataset("valid"), max_tokens=cfg.dataset.max_tokens, seed=cfg.common.seed
    ).next_epoch_itr(shuffle=False)
    with torch.no_grad():
        log_outputs = [task.valid_step(sample, model.eval(), criterion)[2] for sample in batches]
    with metrics.aggregate() as aggregate:
        task.reduce_metrics(log_outputs, criterion)
        result = {key: float(aggregate[key].avg) for key in ("loss", "nll_loss")}
    return {**result, "ntokens": int(sum(log["ntokens"] for log in log_outputs))}


for export, out in zip(sys.argv[1::2], sys.argv[2::2], strict=True):
    with open(out, "w") as f:
        json.dump(validate(export), f)
