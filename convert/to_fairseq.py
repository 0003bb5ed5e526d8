"""Export a pipeline checkpoint as a fairseq Transformer checkpoint.

    python scripts/convert_to_fairseq.py --checkpoint SAVE_DIR [--tag TAG] --data DIR --out OUT

OUT gets checkpoint.pt (fairseq's `model` state dict and the run's config as fairseq-train records it,
in plain containers any torch loads with weights_only: arch transformer, the translation task over OUT,
the run's label-smoothed criterion),
dict.SRC.txt, dict.TGT.txt and the SentencePiece model(s); the data's splits but train as fairseq raw
text (SPLIT.SRC-TGT.LANG); and fathom_export.json, the summary. fairseq-generate (--dataset-impl raw),
fairseq-interactive, fairseq-validate and TransformerModel.from_pretrained run on OUT as on a model
fairseq-train saved.

The checkpoint is read one pipeline layer file at a time, in the order of the parts, and each
layer is folded into its fairseq counterpart (model/fold.py) as it goes: a 500L-500L model is
never held twice. A batch of the data's validation pairs runs through the trained layers and the
folded ones side by side, and the summary reports the largest log-probability difference.
Everything is written to a temporary directory beside OUT and renamed into place when complete.
From Python: `export(run_dir, data, out, tag=..., splits=..., force=...)`, which returns the summary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from fathom.common.checkpoint_format import global_step, layer_file, load_file, schedule_step
from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, exit_on_config_error
from fathom.common.files import save_file, staged
from fathom.common.outputs import check_output_dir
from fathom.common.run_layout import checkpoint_dir
from fathom.convert.fairseq_arguments import fairseq_arguments
from fathom.corpus.batches import collate
from fathom.corpus.data_layout import dictionary_file
from fathom.corpus.dataset import BinarizedCorpus, check_vocab
from fathom.model.fold import folded
from fathom.model.model_config import PAD, ModelConfig
from fathom.model.norms import SCHEMES, build_scheme
from fathom.model.parts import build_parts, fairseq_key
from fathom.model.schedule import ScheduleHook
from fathom.model.trained import missing_layer_files, model_config
from fathom.pipeline.config.history import config_at
from fathom.pipeline.config.run_config import TrainConfig
from fathom.pipeline.parts.stage_modules import PipePart, pipe_parts

CHECKPOINT = "checkpoint.pt"
SUMMARY = "fathom_export.json"
CHECK_PAIRS = 16  # validation pairs run through both models
# fairseq 0.12.2's config of a translation run, every section as fairseq-train saves it: what its own
# convert_namespace_to_omegaconf makes of the arguments {"task": "translation", "criterion":
# "label_smoothed_cross_entropy", "bpe": "sentencepiece"} and LINKED_DEFAULTS, written there by
# tests/workers/fairseq_config.py (fathom cannot import fairseq: it does not import on 3.11). An export
# sets the run's arguments into it; test_an_exports_config_is_the_one_fairseq_makes_of_its_arguments
# compares the result with fairseq's own.
FAIRSEQ_TRAIN_CONFIG = Path(__file__).with_name("fairseq_train_config.json")
# fairseq makes a config from arguments with its own defaults for what they leave out; but a field whose
# default is another field's value ("${common.fp16}") it reads as that string's truth, so those are given.
LINKED_DEFAULTS = {"fp16": False, "memory_efficient_fp16": False, "tpu": False, "grouped_shuffling": False,
                   "update_epoch_batch_itr": False, "model_parallel_size": 1, "distributed_world_size": 1}  # fmt: skip
# base_architecture's arguments for what fathom's model does not have: off, none, or ignored (the block size)
ABSENT_FEATURES = {"encoder_embed_path": None, "decoder_embed_path": None, "encoder_layers_to_keep": None,
                   "decoder_layers_to_keep": None, "encoder_layerdrop": 0, "decoder_layerdrop": 0,
                   "adaptive_softmax_cutoff": None, "adaptive_softmax_dropout": 0, "quant_noise_pq": 0,
                   "quant_noise_pq_block_size": 8, "quant_noise_scalar": 0, "no_scale_embedding": False,
                   "layernorm_embedding": False, "no_token_positional_embeddings": False, "adaptive_input": False,
                   "tie_adaptive_weights": False, "no_cross_attention": False, "cross_self_attention": False,
                   "checkpoint_activations": False, "offload_activations": False}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser(__doc__)
    parser.add_argument("--checkpoint", required=True, help="train.save_dir of a run")
    parser.add_argument("--tag", default=None, help="checkpoint tag, e.g. best or global_step4000 (default: latest)")
    parser.add_argument("--data", required=True, help="the run's data directory (scripts/prepare_data.py)")
    parser.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    parser.add_argument(
        "--splits", nargs="*", default=None, help="splits to write for fairseq-generate (default: all but train)"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    return parser.parse_args(argv)


def fairseq_args(cfg: ModelConfig) -> dict[str, Any]:
    """fairseq's model arguments (arch `transformer`), every one its base_architecture and build_model set:
    fairseq runs base_architecture on a saved config's model section with the section open, where a missing
    key reads as None rather than as its default (decoder_output_dim None built a projection no weights
    fill), and build_model with it closed, where adding a key fails (min_params_to_wrap)."""
    normalize_before = build_scheme(cfg).normalize_before
    return {
        "arch": "transformer",
        **fairseq_arguments(cfg),
        "encoder_normalize_before": normalize_before,
        "decoder_normalize_before": normalize_before,
        "activation_fn": "relu",
        "share_decoder_input_output_embed": cfg.share_decoder_input_output_embed or cfg.share_all_embeddings,
        "decoder_output_dim": cfg.embed_dim,
        "decoder_input_dim": cfg.embed_dim,
        "min_params_to_wrap": 10**8,  # fairseq's default, for FSDP, which an export never runs under
        **ABSENT_FEATURES,
    }


def fairseq_extras(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """Adds the entries fairseq expects beyond the weights: tied aliases, versions, position buffers."""
    if cfg.share_all_embeddings:
        state["decoder.embed_tokens.weight"] = state["encoder.embed_tokens.weight"]
    if cfg.share_all_embeddings or cfg.share_decoder_input_output_embed:
        state["decoder.output_projection.weight"] = state["decoder.embed_tokens.weight"]
    for side in ("encoder", "decoder"):
        # without the version fairseq's upgrade drops the final LayerNorm of a Pre-LN model
        state[f"{side}.version"] = torch.tensor([3.0])
        if not cfg.learned_pos:
            # fairseq reads only this placeholder's dtype and device; zeros rather than FloatTensor(1)'s
            # uninitialized memory, so that an export is the same bytes every time
            state[f"{side}.embed_positions._float_tensor"] = torch.zeros(1)


class PartRunner:
    """Runs a batch through the model's parts one at a time, as the pipeline would."""

    def __init__(self, inputs: tuple[torch.Tensor, ...]):
        self.activations: tuple[torch.Tensor, ...] | torch.Tensor = inputs

    @torch.no_grad()
    def __call__(self, part: PipePart, module: nn.Module) -> None:
        self.activations = part.run(module, self.activations)

    def log_probs(self) -> torch.Tensor:
        return F.log_softmax(self.activations.float(), dim=-1)


def write_raw_split(data: Path, split: str, out: Path) -> None:
    """A split as fairseq's raw text dataset (--dataset-impl raw): SPLIT.SRC-TGT.LANG, one line of
    space-separated pieces per sentence, so fairseq-generate reads exactly our token ids."""
    corpus = BinarizedCorpus(data, split)
    for lang, sentences, dictionary in (
        (corpus.src, corpus.sources, corpus.src_dict),
        (corpus.tgt, corpus.targets, corpus.tgt_dict),
    ):
        lines = (" ".join(dictionary.symbols[i] for i in sentences[n].tolist()) + "\n" for n in range(len(corpus)))
        (out / f"{split}.{corpus.src}-{corpus.tgt}.{lang}").write_text("".join(lines), encoding="utf-8")


def load_layer(path: Path, module: nn.Module) -> None:
    state = load_file(path)
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        reason = str(err).splitlines()[0]
        raise ConfigError(f"{path}: cannot load ({reason}); the checkpoint is damaged or from another model") from None


def fairseq_run_args(
    cfg: ModelConfig, train: dict[str, Any], corpus: BinarizedCorpus, out: Path, spm_files: list[Path]
) -> dict[str, Any]:
    """The run's arguments as fairseq-train's command line would give them: the model's, the translation
    task over the export directory `out` (its dictionaries and raw splits), the label-smoothed cross-entropy
    with the run's smoothing averaged over target tokens, as fathom's is, the run's seed, and SentencePiece
    when one model serves both sides (from_pretrained then translates raw text)."""
    args = {
        **fairseq_args(cfg),
        **LINKED_DEFAULTS,
        "task": "translation",
        "data": str(out.resolve()),
        "source_lang": corpus.src,
        "target_lang": corpus.tgt,
        "dataset_impl": "raw",
        "criterion": "label_smoothed_cross_entropy",
        "label_smoothing": train["label_smoothing"],
        "sentence_avg": False,
        "seed": train["seed"],
    }
    if len(spm_files) == 1:
        args.update(bpe="sentencepiece", sentencepiece_model=str(out.resolve() / spm_files[0].name))
    return args


def fairseq_train_config(args: dict[str, Any]) -> dict[str, Any]:
    """The config fairseq-train saves for a run of these arguments (fairseq_run_args), in plain containers:
    fairseq 0.12.2 loads a checkpoint with torch.load's defaults, which since torch 2.6 refuse to unpickle
    an argparse.Namespace (the `args` fathom saved before). As fairseq's own conversion does, each argument
    sets the field of its name in every section, and the model section holds them all: arch transformer
    has no config class, and fairseq-train saves its whole namespace there (pickled, a Namespace)."""
    cfg = json.loads(FAIRSEQ_TRAIN_CONFIG.read_text(encoding="utf-8"))
    for section in cfg.values():
        if isinstance(section, dict):
            section.update({key: args[key] for key in section.keys() & args.keys()})
    cfg["model"] = {**args, "_name": args["arch"]}
    if "bpe" not in args:
        cfg["bpe"] = None  # FAIRSEQ_TRAIN_CONFIG's is SentencePiece's
    return cfg


def trained_with(save_dir: Path, step: int) -> dict[str, Any]:
    """The run's train section at `step`: what fairseq records of it comes from there (TrainConfig's
    defaults for a directory without one, an import)."""
    train = config_at(save_dir, step).get("train", {})
    return {key: train.get(key, getattr(TrainConfig, key)) for key in ("label_smoothing", "seed")}


def fairseq_checkpoint(cfg: dict[str, Any], state: dict[str, torch.Tensor], summary: dict) -> dict:
    """What fairseq's checkpoint_utils reads: the run's config (fairseq_train_config), the weights and an
    optimizer history; `args` None, as fairseq-train saves them since 0.10."""
    return {
        "args": None,
        "cfg": cfg,
        "model": state,
        "optimizer_history": [
            {
                "criterion_name": "LabelSmoothedCrossEntropyCriterion",
                "optimizer_name": "Adam",
                "lr_scheduler_state": {},
                "num_updates": summary["step"],
            }
        ],
        "extra_state": {"fathom": summary},
        "last_optimizer_state": None,
    }


@dataclass
class Export:
    checkpoint: Path
    cfg: ModelConfig
    fairseq_cfg: ModelConfig  # what cfg folds into
    step: int

    @classmethod
    def open(cls, save_dir: str | Path, tag: str | None) -> Export:
        """Checks everything about the checkpoint that can be checked before reading its layers."""
        cfg = model_config(save_dir)
        scheme = build_scheme(cfg)
        if scheme.fairseq_layout is None:
            raise ConfigError(
                f"model.norm_scheme '{cfg.norm_scheme}' cannot be exported to a plain fairseq Transformer "
                f"({scheme.fairseq_export}); schemes that can: "
                + ", ".join(name for name, s in SCHEMES.items() if s.fairseq_layout is not None)
            )
        checkpoint = checkpoint_dir(save_dir, tag)
        missing_layer_files(cfg, checkpoint)
        return cls(checkpoint, cfg, scheme.fairseq_config(), schedule_step(checkpoint))

    def folded_layers(self, trained: PartRunner) -> Iterator[tuple[PipePart, nn.Module]]:
        """(fairseq part, folded fairseq module) in the parts' order, each built when its turn comes;
        `trained` runs the trained layers."""
        parts, fairseq_parts = pipe_parts(self.cfg), pipe_parts(self.fairseq_cfg)

        def pairs():
            built = zip(parts, fairseq_parts, build_parts(parts), build_parts(fairseq_parts), strict=True)
            for index, (part, fairseq_part, module, fairseq_module) in enumerate(built):
                module.eval()
                fairseq_module.eval()
                if part.saved:
                    load_layer(layer_file(self.checkpoint, index), module)
                ScheduleHook(module)(self.step)  # BranchNorm's alpha_t at the checkpoint's step
                trained(part, module)
                yield fairseq_part, module, fairseq_module

        yield from folded(pairs())

    def fairseq_state(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
        """The folded model's fairseq state dict, and its largest log-probability difference from the
        trained model on `batch`, over real target positions (eps dominates a pad position's state,
        which nothing reads)."""
        trained, exported = PartRunner(batch), PartRunner(batch)
        state: dict[str, torch.Tensor] = {}
        layers = tqdm(
            self.folded_layers(trained),
            total=len(pipe_parts(self.cfg)),
            desc="converting",
            unit="layer",
            file=sys.stderr,
        )
        for part, module in layers:
            exported(part, module)
            if part.saved:
                for key, value in module.state_dict().items():
                    state[fairseq_key(part.name, key)] = value
        fairseq_extras(self.fairseq_cfg, state)
        real = batch[1].ne(PAD)
        return state, (trained.log_probs() - exported.log_probs()).abs()[real].max().item()

    def write(
        self, out: Path, data: Path, final: Path, splits: list[str] | None, check_pairs: int = CHECK_PAIRS
    ) -> dict[str, object]:
        """Writes the fairseq directory into `out`, to be renamed to `final`, with `splits` as raw text
        (None: all but train); returns the summary."""
        corpus = BinarizedCorpus(data, "valid")
        if splits is None:
            splits = [split for split in corpus.meta["splits"] if split != "train"]
        check_vocab(self.checkpoint.parent, self.cfg, corpus)
        spm_files = sorted({corpus.sentencepiece_model(lang) for lang in (corpus.src, corpus.tgt)})
        batch, _ = collate([corpus.pair(i) for i in range(min(check_pairs, len(corpus)))])
        state, difference = self.fairseq_state(batch)
        summary = {
            "checkpoint": str(self.checkpoint),
            "step": self.step,
            "norm_scheme": self.cfg.norm_scheme,
            "fairseq_layout": self.fairseq_cfg.norm_scheme,
            "encoder_layers": self.cfg.encoder_layers,
            "decoder_layers": self.cfg.decoder_layers,
            "parameters": sum(
                {v.data_ptr(): v.numel() for k, v in state.items() if k.endswith(("weight", "bias"))}.values()
            ),
            "max_abs_log_prob_difference": difference,
            "checked_on": f"{batch[0].size(0)} pairs of {data}/valid",
        }
        train = trained_with(self.checkpoint.parent, global_step(self.checkpoint))
        cfg = fairseq_train_config(fairseq_run_args(self.fairseq_cfg, train, corpus, final, spm_files))
        save_file(fairseq_checkpoint(cfg, state, summary), out / CHECKPOINT)
        for lang in (corpus.src, corpus.tgt):
            shutil.copy(Path(data) / dictionary_file(lang), out / dictionary_file(lang))
        for path in spm_files:
            shutil.copy(path, out / path.name)
        for split in splits:
            write_raw_split(data, split, out)
        (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def export(
    run_dir: str | Path,
    data: str | Path,
    out: str | Path,
    tag: str | None = None,
    splits: list[str] | None = None,
    force: bool = False,
) -> dict[str, object]:
    """Writes the run's checkpoint `tag` (default: latest) as the fairseq directory `out` (replacing one
    this wrote only with `force`), with the prepared `data` the run was trained on and its `splits` as raw
    text (default: all but train); returns the summary, fathom_export.json. Fails in one ConfigError line
    before writing anything where the checkpoint, the data or `out` cannot be used."""
    out = Path(out)
    check_output_dir(out, force, SUMMARY, [run_dir, data])
    opened = Export.open(run_dir, tag)
    with staged(out, force) as staging:
        return opened.write(staging, Path(data), out, splits)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_config_error():
        summary = export(args.checkpoint, args.data, args.out, args.tag, args.splits, args.force)
    print(
        f"wrote {Path(args.out) / CHECKPOINT}: {summary['norm_scheme']} at step {summary['step']} as a fairseq "
        f"transformer ({summary['fairseq_layout']}), {summary['encoder_layers']}L-{summary['decoder_layers']}L, "
        f"{summary['parameters']:,} parameters"
    )
    print(
        f"folding changed log-probabilities by at most {summary['max_abs_log_prob_difference']:.2e} "
        f"({summary['checked_on']})"
    )
