"""fathom's model and torchscale's, trained side by side in one process on the micro-batches a run of
the config sees, with the same optimizer, schedule and clipping: to tell a scheme's own training
dynamics from a defect of fathom's. At each --at step it prints, per model, the validation loss with
real and with shuffled sources (the depth study's test of whether the source is used) and the spread
of the encoder's output across tokens (near 0: every token encodes alike).

    python scripts/compare_training.py --config ds_configs/study_multi30k_base.json \\
        --override model.norm_scheme=deepnorm model.deepnorm.init=torchscale --at 50 150 300

The config's scheme must be one torchscale has (tools/torchscale_peer.py). Models start from their own
seeded draws, so compare trends, not digits.

With --same-weights the two train in lockstep from one set of weights (torchscale's loaded with fathom's
initial draw) on the same micro-batches, without dropout (its draws differ between implementations): the
two losses of every update, the step-1 difference (float rounding) and the largest relative difference
over the run against --tolerance. The depth study's control for fathom itself (docs/STABILITY.md):

    python scripts/compare_training.py --config ds_configs/study_multi30k_papers_base.json --same-weights \
        --override model.norm_scheme=deepnorm model.encoder_layers=25 model.decoder_layers=25 \
        model.dropout=0 train.max_steps=200 --at 1 50 100 150 200
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from deepspeed.runtime import lr_schedules
from torch import nn

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, check_number, exit_on_config_error
from fathom.corpus.batches import MicroBatches, ParallelCorpus, collate
from fathom.model import Transformer
from fathom.model.loss import label_smoothed_cross_entropy
from fathom.model.model_config import PAD
from fathom.pipeline.config.inverse_sqrt import client_scheduler
from fathom.pipeline.config.run_config import RunConfig
from fathom.pipeline.config.run_data import build_corpus, resolve_run
from fathom.study.source_use import nll, with_shuffled_sources
from fathom.tools.torchscale_peer import load_our_weights, torchscale_model

ENCODER_SPREAD_SENTENCES = 64
DROPOUTS = ("dropout", "attention_dropout", "activation_dropout")


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


def adamw(cfg: RunConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = cfg.settings.optimizer.params
    return torch.optim.AdamW(  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
        model.parameters(), lr=params["lr"], betas=params["betas"], eps=params["eps"],
        weight_decay=params["weight_decay"],
    )  # fmt: skip


class Trainee:
    """One model with its optimizer and schedule, updated as DeepSpeed's engine updates a run's model."""

    def __init__(self, cfg: RunConfig, model: nn.Module):
        self.cfg, self.model = cfg, model
        self.optimizer = adamw(cfg, model)
        self.scheduler = build_scheduler(cfg, self.optimizer)

    def update(self, micro_batches: list[Any]) -> float:
        """One optimizer step over `micro_batches`; their mean loss."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for (src, prev), target in micro_batches:
            loss = label_smoothed_cross_entropy(self.model(src, prev), target, smoothing=self.cfg.train.label_smoothing)
            (loss / len(micro_batches)).backward()
            total += loss.item()
        nn.utils.clip_grad_norm_(
            self.model.parameters(), self.cfg.settings.gradient_clipping or float("inf")
        )  # 0: none
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return total / len(micro_batches)


def corpora(cfg: RunConfig) -> tuple[ParallelCorpus, ParallelCorpus, int]:
    """The run's training and validation pairs, read once, and the longest pair of either."""
    train, valid = build_corpus(cfg, "train"), build_corpus(cfg, "valid")
    return train, valid, int(max(train.lengths().max(), valid.lengths().max()))


def train_and_probe(name: str, cfg: RunConfig, at: list[int]) -> None:
    train, valid, longest = corpora(cfg)
    pairs, shuffled = with_shuffled_sources(valid)
    probe_sources = collate(pairs[:ENCODER_SPREAD_SENTENCES])[0][0]
    torch.manual_seed(cfg.train.seed)
    model, encode = build(name, cfg, max_positions=longest + 3)
    trainee, accumulation = Trainee(cfg, model), cfg.settings.accumulation(replicas=1)
    data = MicroBatches(train, cfg.batch_size, cfg.train.seed)
    tick = time.monotonic()
    model.eval()
    print(f"{name:10s} step {0:4d}  encoder spread {encoder_spread(encode, probe_sources):.3f}", flush=True)
    for step in range(1, max(at) + 1):
        trainee.update([next(data) for _ in range(accumulation)])
        if step in at:
            model.eval()
            real, other = nll(model, pairs), nll(model, shuffled)
            print(
                f"{name:10s} step {step:4d}  valid nll {real:.3f}, shuffled sources {other:.3f} "
                f"({other - real:+.3f})  encoder spread {encoder_spread(encode, probe_sources):.3f}  "
                f"{time.monotonic() - tick:.0f} s",
                flush=True,
            )


def train_in_lockstep(cfg: RunConfig, updates: int, at: list[int], tolerance: float) -> float:
    """fathom's model and torchscale's from fathom's initial weights, `updates` updates on the same
    micro-batches; prints both losses at the `at` steps and a summary; returns the largest relative difference."""
    train, _, longest = corpora(cfg)
    torch.manual_seed(cfg.train.seed)
    ours = Trainee(cfg, build("fathom", cfg, 0)[0])
    theirs_model = Torchscale(torchscale_model(cfg.model, longest + 3))
    load_our_weights(theirs_model.model, ours.model)
    theirs, accumulation = Trainee(cfg, theirs_model), cfg.settings.accumulation(replicas=1)
    data = MicroBatches(train, cfg.batch_size, cfg.train.seed)
    tick, worst, worst_step, first = time.monotonic(), 0.0, 0, 0.0
    for step in range(1, updates + 1):
        batches = [next(data) for _ in range(accumulation)]
        a, b = ours.update(batches), theirs.update(batches)
        relative = abs(a - b) / abs(a)
        first = relative if step == 1 else first
        worst, worst_step = max((worst, worst_step), (relative, step))
        if step in at:
            print(f"step {step:4d}  loss fathom {a:.6f}  torchscale {b:.6f}  relative difference {relative:.2e}  "
                  f"{time.monotonic() - tick:.0f} s", flush=True)  # fmt: skip
    verdict = "within" if worst <= tolerance else "OUTSIDE"
    print(f"same weights, same micro-batches, {updates} updates: relative loss difference {first:.2e} at step 1, "
          f"at most {worst:.2e} (step {worst_step}), {verdict} the tolerance {tolerance:g}", flush=True)  # fmt: skip
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = command_parser(__doc__)
    parser.add_argument("--config", required=True, help="an experiment config with a prepared data.path")
    parser.add_argument("--override", nargs="*", default=[], help="dotted KEY=VALUE changes, as train.py takes")
    parser.add_argument("--at", type=int, nargs="+", required=True, help="the steps to measure after")
    parser.add_argument("--models", nargs="+", choices=("fathom", "torchscale"), default=["fathom", "torchscale"])
    parser.add_argument(
        "--same-weights",
        action="store_true",
        help="train both in lockstep from fathom's initial weights for train.max_steps updates",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.01,
        help="with --same-weights: the relative loss difference allowed (default 0.01)",
    )
    args = parser.parse_args(argv)
    with exit_on_config_error():
        if min(args.at) < 1:
            raise ConfigError(f"--at: steps start at 1, got {min(args.at)}")
        check_number("--tolerance", args.tolerance, 0)
        cfg, _ = resolve_run(args.config, args.override, world_size=None)
        if cfg.data.directory is None:
            raise ConfigError("data.path: compare_training needs a prepared data directory")
        if "torchscale" in args.models or args.same_weights:
            torchscale_model(cfg.model, 8)  # its one-line error for a scheme torchscale lacks, before training
        if args.same_weights and (rates := {k: getattr(cfg.model, k) for k in DROPOUTS if getattr(cfg.model, k)}):
            key = next(iter(rates))
            raise ConfigError(f"model.{key}: {rates[key]}; --same-weights compares without dropout, whose draws "
                              f"differ between the implementations: add model.{key}=0")  # fmt: skip
    if args.same_weights:
        train_in_lockstep(cfg, cfg.train.max_steps, sorted(set(args.at)), args.tolerance)
        return
    for name in args.models:
        train_and_probe(name, cfg, sorted(set(args.at)))
