"""fathom's model and torchscale's, trained side by side in one process on the micro-batches a run of
the config sees, with the same optimizer, schedule and clipping: to tell a scheme's own training
dynamics from a defect of fathom's. At each --at step it prints, per model, the validation loss with
real and with shuffled sources (the depth study's test of whether the source is used) and the spread
of the encoder's output across tokens (near 0: every token encodes alike).

    python scripts/compare_training.py --config ds_configs/study_multi30k_base.json \\
        --override model.norm_scheme=deepnorm model.deepnorm.init=torchscale --at 50 150 300

The config's scheme must be one torchscale has (tools/torchscale_peer.py). Models start from their own
seeded draws, so compare trends, not digits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from deepspeed.runtime import lr_schedules
from torch import nn

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, exit_on_config_error
from fathom.corpus.batches import MicroBatches, collate
from fathom.model import Transformer
from fathom.model.loss import label_smoothed_cross_entropy
from fathom.model.model_config import PAD
from fathom.pipeline.config.inverse_sqrt import client_scheduler
from fathom.pipeline.config.run_config import RunConfig
from fathom.pipeline.config.run_data import build_corpus, resolve_run
from fathom.study.source_use import nll, with_shuffled_sources
from fathom.tools.torchscale_peer import torchscale_model

ENCODER_SPREAD_SENTENCES = 64


class Torchscale(nn.Module):
    """torchscale's EncoderDecoder called as ours is: logits of (src_tokens, prev_output_tokens), with
    source padding masked (its own forward attends to it)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def encoder_out(self, src_tokens: torch.Tensor) -> dict[str, Any]:
        return self.model.encoder(src_tokens, encoder_padding_mask=src_tokens.eq(PAD))

    def encode(self, src_tokens: torch.Tensor) -> torch.Tensor:
        out = self.encoder_out(src_tokens)["encoder_out"]
        return out.transpose(0, 1) if out.shape[0] != src_tokens.shape[0] else out

    def forward(self, src_tokens: torch.Tensor, prev_output_tokens: torch.Tensor) -> torch.Tensor:
        return self.model.decoder(prev_output_tokens, encoder_out=self.encoder_out(src_tokens))[0]


def build(name: str, cfg: RunConfig, max_positions: int) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """The model and its encoder (tokens -> batch x time x dim)."""
    if name == "fathom":
        model = Transformer(cfg.model)
        return model, model.encoder
    model = Torchscale(torchscale_model(cfg.model, max_positions))
    return model, model.encode


def build_scheduler(cfg: RunConfig, optimizer: torch.optim.Optimizer) -> Any:
    """The config's DeepSpeed scheduler, which the engine steps after every optimizer step; None without one."""
    scheduler = cfg.settings.scheduler
    if scheduler is None:
        return None
    if ours := client_scheduler(cfg.deepspeed):  # fathom's InverseSqrtLR, which the engine gets built too
        return ours(optimizer)
    return getattr(lr_schedules, scheduler.type)(optimizer, **scheduler.params)


@torch.no_grad()
def encoder_spread(encode: Callable[[torch.Tensor], torch.Tensor], src_tokens: torch.Tensor) -> float:
    """Std across the batch's real tokens of the encoder output, averaged over dimensions."""
    return encode(src_tokens)[src_tokens.ne(PAD)].std(0).mean().item()


def train_and_probe(name: str, cfg: RunConfig, at: list[int]) -> None:
    train, valid = build_corpus(cfg, "train"), build_corpus(cfg, "valid")
    pairs, shuffled = with_shuffled_sources(valid)
    probe_sources = collate(pairs[:ENCODER_SPREAD_SENTENCES])[0][0]
    torch.manual_seed(cfg.train.seed)
    longest = int(max(train.lengths().max(), valid.lengths().max()))
    model, encode = build(name, cfg, max_positions=longest + 3)
    accumulation = cfg.settings.accumulation(replicas=1)
    data = MicroBatches(train, cfg.batch_size, cfg.train.seed)
    params = cfg.settings.optimizer.params
    optimizer = torch.optim.AdamW(  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
        model.parameters(),
        lr=params["lr"],
        betas=params["betas"],
        eps=params["eps"],
        weight_decay=params["weight_decay"],
    )
    scheduler = build_scheduler(cfg, optimizer)
    tick = time.monotonic()
    model.eval()
    print(f"{name:10s} step {0:4d}  encoder spread {encoder_spread(encode, probe_sources):.3f}", flush=True)
    for step in range(1, max(at) + 1):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for _ in range(accumulation):
            (src, prev), target = next(data)
            loss = label_smoothed_cross_entropy(model(src, prev), target, smoothing=cfg.train.label_smoothing)
            (loss / accumulation).backward()
        nn.utils.clip_grad_norm_(model.parameters(), cfg.settings.gradient_clipping or float("inf"))  # 0: none
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if step in at:
            model.eval()
            real, other = nll(model, pairs), nll(model, shuffled)
            print(
                f"{name:10s} step {step:4d}  valid nll {real:.3f}, shuffled sources {other:.3f} "
                f"({other - real:+.3f})  encoder spread {encoder_spread(encode, probe_sources):.3f}  "
                f"{time.monotonic() - tick:.0f} s",
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    parser = command_parser(__doc__)
    parser.add_argument("--config", required=True, help="an experiment config with a prepared data.path")
    parser.add_argument("--override", nargs="*", default=[], help="dotted KEY=VALUE changes, as train.py takes")
    parser.add_argument("--at", type=int, nargs="+", required=True, help="the steps to measure after")
    parser.add_argument("--models", nargs="+", choices=("fathom", "torchscale"), default=["fathom", "torchscale"])
    args = parser.parse_args(argv)
    with exit_on_config_error():
        if min(args.at) < 1:
            raise ConfigError(f"--at: steps start at 1, got {min(args.at)}")
        cfg, _ = resolve_run(args.config, args.override, world_size=None)
        if cfg.data.directory is None:
            raise ConfigError("data.path: compare_training needs a prepared data directory")
        if "torchscale" in args.models:
            torchscale_model(cfg.model, 8)  # its one-line error for a scheme torchscale lacks, before training
    for name in args.models:
        train_and_probe(name, cfg, sorted(set(args.at)))
