"""Import a fairseq Transformer checkpoint (Post-LN or Pre-LN) as a pipeline checkpoint.

    python scripts/convert_from_fairseq.py --fairseq-checkpoint FAIRSEQ.pt [--data FAIRSEQ_DATA] --out DIR

DIR gets config.json (the model section), the weights as DeepSpeed's per-layer files under the tag
`fairseq`, readable at any stage count, and the model's dictionaries: dict.SRC.txt and dict.TGT.txt from
the data directory fairseq-train read (--data, default the one the checkpoint names), recorded by
checksum in dictionaries.json as a run records its own. Prepare data with them (scripts/prepare_data.py
--spm-model MODEL --dict DIR/dict.SRC.txt DIR/dict.TGT.txt) and start a run from the weights with
`--override train.init_from=DIR` (the run's model section must describe the same model), or translate
with them directly: `scripts/generate.py --checkpoint DIR --data ...`; data with other dictionaries is
refused, as for a run. From Python: `import_fairseq(fairseq_checkpoint, out, data=..., force=...)`.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from fathom.common.checkpoint_format import layer_file
from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, exit_on_config_error
from fathom.common.files import save_file, staged
from fathom.common.outputs import check_output_dir
from fathom.common.run_layout import CONFIG_FILE, IMPORT_SUMMARY, LATEST
from fathom.convert.fairseq_arguments import read_arguments
from fathom.corpus.data_layout import dictionary_file
from fathom.corpus.dataset import Dictionary, dictionary_digests, record_dictionaries
from fathom.model.model_config import ModelConfig
from fathom.model.model_section import model_section
from fathom.model.parts import fairseq_key, model_parts

TAG = "fairseq"
# fairseq's bookkeeping, and the aliases of tied tables (read through their first use)
NOT_WEIGHTS = {
    "encoder.version",
    "decoder.version",
    "encoder.embed_positions._float_tensor",
    "decoder.embed_positions._float_tensor",
    "decoder.embed_tokens.weight",
    "decoder.output_projection.weight",
}
# fairseq 0.12's encoder layers also save copies of their weights for its BetterTransformer path
# (in_proj_weight = [q; k; v], fc1_weight, ...), which its loader rebuilds from q/k/v, fc1, ...
BETTER_TRANSFORMER_COPY = re.compile(r"encoder\.layers\.\d+\.(in_proj|out_proj|fc1|fc2)_(weight|bias)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser(__doc__)
    parser.add_argument(
        "--fairseq-checkpoint",
        required=True,
        help="a fairseq checkpoint file (arch transformer*), e.g. checkpoint_best.pt",
    )
    parser.add_argument(
        "--data",
        default=None,
        help="the data directory fairseq-train read, with dict.SRC.txt and dict.TGT.txt (default: the one the "
        "checkpoint names)",
    )
    parser.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    return parser.parse_args(argv)


@dataclass
class FairseqCheckpoint:
    args: dict[str, Any]  # the model's arguments
    task: dict[str, Any]  # the task's: data, source_lang, target_lang
    state: dict[str, torch.Tensor]


def read_checkpoint(path: Path) -> FairseqCheckpoint:
    """A fairseq checkpoint's model and task arguments and state dict, loaded without running pickled code."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; pass a fairseq checkpoint such as checkpoint_best.pt")
    try:
        # fairseq pickles an argparse.Namespace: `args` before 0.10, and since then the model section of the
        # config of an arch without a config class (transformer); fathom's exports hold none
        with torch.serialization.safe_globals([argparse.Namespace]):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises several types for damaged or foreign files
        reason = str(err).strip().splitlines()[0][:200]
        raise ConfigError(f"{path}: not a loadable fairseq checkpoint ({reason})") from None
    if not isinstance(checkpoint, dict) or "model" not in checkpoint:
        raise ConfigError(f"{path}: not a fairseq checkpoint (no 'model' entry)")
    cfg = checkpoint.get("cfg") or {}
    args = checkpoint.get("args") or cfg.get("model")  # fairseq-train's before 0.10 and since
    if args is None:
        raise ConfigError(f"{path}: has neither 'args' nor 'cfg.model'; cannot tell its architecture")
    task = checkpoint.get("args") or cfg.get("task") or {}
    # a pickled Namespace is data here, not a command line: read as the dict it holds
    args, task = (vars(s) if isinstance(s, argparse.Namespace) else dict(s) for s in (args, task))
    return FairseqCheckpoint(args, task, checkpoint["model"])


def model_config_from(args: dict[str, Any], state: dict[str, torch.Tensor], path: Path) -> ModelConfig:
    """Our model section for a fairseq transformer, refusing options this model does not have."""
    arch = args.get("arch") or args.get("_name") or ""
    if not arch.startswith("transformer"):
        raise ConfigError(f"{path}: arch '{arch}' is not a fairseq transformer; only transformer* archs convert")

    unsupported = {
        "activation_fn": ("relu", args.get("activation_fn", "relu")),
        "layernorm_embedding": (False, bool(args.get("layernorm_embedding"))),
        "no_scale_embedding": (False, bool(args.get("no_scale_embedding"))),
        "no_token_positional_embeddings": (False, bool(args.get("no_token_positional_embeddings"))),
        "adaptive_softmax_cutoff": (None, args.get("adaptive_softmax_cutoff")),
        "cross_self_attention": (False, bool(args.get("cross_self_attention"))),
    }
    for key, (wanted, value) in unsupported.items():
        if value != wanted:
            raise ConfigError(f"{path}: {key}={value} is not supported (this model has {key}={wanted})")
    decoder_output_dim = args.get("decoder_output_dim") or args.get("decoder_embed_dim")
    if decoder_output_dim != args.get("decoder_embed_dim"):
        raise ConfigError(f"{path}: decoder_output_dim={decoder_output_dim} differs from decoder_embed_dim")
    fields = read_arguments(args, path)
    normalize_before = {bool(args.get(f"{side}_normalize_before")) for side in ("encoder", "decoder")}
    if len(normalize_before) > 1:
        raise ConfigError(f"{path}: encoder_normalize_before and decoder_normalize_before differ; both must agree")
    return ModelConfig(
        **fields,
        share_decoder_input_output_embed=bool(args.get("share_decoder_input_output_embed"))
        and not fields["share_all_embeddings"],
        norm_scheme="pre_ln" if normalize_before.pop() else "post_ln",
        src_vocab_size=state["encoder.embed_tokens.weight"].size(0),
        tgt_vocab_size=state["decoder.embed_tokens.weight"].size(0),
    )


def write_layers(cfg: ModelConfig, state: dict[str, torch.Tensor], checkpoint: Path, source: Path) -> None:
    """One file per pipeline layer, as DeepSpeed's save_checkpoint names them; every weight must fit."""
    used = set()
    for index, part in enumerate(model_parts(cfg)):
        if not part.saved:  # a tied re-use: saved with its first use
            continue
        name, module = part.name, part.build()
        ours = {key: state.get(fairseq_key(name, key)) for key in module.state_dict()}
        if missing := [fairseq_key(name, key) for key, value in ours.items() if value is None]:
            raise ConfigError(
                f"{source}: no weight {missing[0]} ({len(missing)} missing); not a complete fairseq transformer"
            )
        try:
            module.load_state_dict(ours)
        except RuntimeError as err:
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            reason = next((line for line in lines if "size mismatch" in line), lines[0])
            raise ConfigError(f"{source}: {name}: {reason}") from None
        used.update(fairseq_key(name, key) for key in ours)
        save_file(module.state_dict(), layer_file(checkpoint, index))
    if extra := sorted(k for k in set(state) - used - NOT_WEIGHTS if not BETTER_TRANSFORMER_COPY.fullmatch(k)):
        raise ConfigError(f"{source}: weight {extra[0]} has no place in this model ({len(extra)} such); not converted")


def language_pair(directory: Path) -> tuple[str, str] | None:
    """The languages fairseq-train infers from a data directory when not given them: the first file named
    SPLIT.SRC-TGT.* (train.de-en.de.bin, ...)."""
    for name in sorted(path.name for path in directory.iterdir()):
        parts = name.split(".")
        if len(parts) >= 3 and len(pair := parts[1].split("-")) == 2 and all(pair):
            return pair[0], pair[1]
    return None


def model_dictionaries(
    task: dict[str, Any], data: str | Path | None, cfg: ModelConfig, source: Path
) -> tuple[Path, dict[str, Dictionary]]:
    """The data directory the model was trained on (`data`, default the one its task names) and its
    dictionaries, {language: dictionary}, each the size of its side's embeddings."""
    fix = "pass --data, the data directory fairseq-train read (with the dictionaries dict.SRC.txt and dict.TGT.txt)"
    where = data or str(task.get("data") or "").split(":")[0]  # fairseq's shards each hold the dictionaries
    if not where:
        raise ConfigError(f"{source}: names no data directory; {fix}")
    directory = Path(where)
    if not directory.is_dir():
        raise ConfigError(f"{directory}: no such directory (the model's data directory); {fix}")
    langs = (task.get("source_lang"), task.get("target_lang"))
    if None in langs and (langs := language_pair(directory)) is None:
        raise ConfigError(
            f"{directory}: cannot tell the languages (the checkpoint names none, and no file is named "
            f"SPLIT.SRC-TGT.*); {fix}"
        )
    dictionaries = {}
    for lang, side, size in zip(langs, ("encoder", "decoder"), (cfg.src_vocab_size, cfg.tgt_vocab_size), strict=True):
        path = directory / dictionary_file(lang)
        if not path.is_file():
            raise ConfigError(f"{path}: missing; {fix}")
        dictionaries[lang] = Dictionary.load(path)
        if len(dictionaries[lang]) != size:
            raise ConfigError(
                f"{path}: {len(dictionaries[lang])} entries, but the model's {side} embeds {size} tokens; {fix}"
            )
    return directory, dictionaries


class Imported(NamedTuple):
    model: ModelConfig
    languages: list[str]  # of the dictionaries: source, target


def import_fairseq(
    fairseq_checkpoint: str | Path, out: str | Path, data: str | Path | None = None, force: bool = False
) -> Imported:
    """Writes the fairseq checkpoint file as the run directory `out` (replacing one this wrote only with
    `force`), with the dictionaries of `data`, the data directory fairseq-train read (default: the one
    the checkpoint names). Fails in one ConfigError line before writing anything where the checkpoint,
    the dictionaries or `out` cannot be used."""
    source, out = Path(fairseq_checkpoint), Path(out)
    check_output_dir(out, force, IMPORT_SUMMARY, [source])
    checkpoint = read_checkpoint(source)
    cfg = model_config_from(checkpoint.args, checkpoint.state, source)
    directory, dictionaries = model_dictionaries(checkpoint.task, data, cfg, source)
    with staged(out, force) as staging:
        (staging / TAG).mkdir()
        write_layers(cfg, checkpoint.state, staging / TAG, source)
        (staging / LATEST).write_text(TAG)
        (staging / CONFIG_FILE).write_text(json.dumps({"model": model_section(cfg)}, indent=2) + "\n")
        for lang, dictionary in dictionaries.items():
            dictionary.save(staging / dictionary_file(lang))  # as prepare_data writes one, which it is compared with
        record_dictionaries(staging, dictionary_digests(staging, dictionaries), directory.resolve())
        (staging / IMPORT_SUMMARY).write_text(json.dumps({"converted_from": str(source.resolve())}, indent=2) + "\n")
    return Imported(cfg, list(dictionaries))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_config_error():
        cfg, langs = import_fairseq(args.fairseq_checkpoint, args.out, args.data, args.force)
    dictionaries = " ".join(str(Path(args.out) / dictionary_file(lang)) for lang in langs)
    print(
        f"wrote {args.out}: fairseq transformer as {cfg.norm_scheme}, {cfg.encoder_layers}L-{cfg.decoder_layers}L, "
        f"d={cfg.embed_dim}; prepare data with its dictionaries (scripts/prepare_data.py --spm-model MODEL --dict "
        f"{dictionaries}) and start a run from it with --override train.init_from={args.out}"
    )
