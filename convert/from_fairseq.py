"""Import a fairseq Transformer checkpoint (Post-LN or Pre-LN) as a pipeline checkpoint.

    python scripts/convert_from_fairseq.py --fairseq-checkpoint FAIRSEQ.pt --out DIR

DIR gets config.json (the model section) and the weights as DeepSpeed's per-layer files under
the tag `fairseq`, readable at any stage count. Start a run from them with
`--override train.init_from=DIR` (the run's model section must describe the same model), or
translate with them directly: `scripts/generate.py --checkpoint DIR --data ...`.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import torch

from common.checkpoint_format import layer_file
from common.errors import ConfigError, exit_on_config_error
from common.files import save_file, staged
from common.outputs import check_output_dir
from common.run_layout import CONFIG_FILE, LATEST
from model.model_config import ModelConfig
from model.norms import model_section
from model.parts import fairseq_key, model_parts

TAG = "fairseq"
SUMMARY = "fathom_import.json"  # marks a directory this script wrote, which --force may replace
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--fairseq-checkpoint",
        required=True,
        help="a fairseq checkpoint file (arch transformer*), e.g. checkpoint_best.pt",
    )
    parser.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    return parser.parse_args(argv)


def read_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(model arguments, state dict) of a fairseq checkpoint, loaded without running pickled code."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; pass a fairseq checkpoint such as checkpoint_best.pt")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises several types for damaged or foreign files
        reason = str(err).strip().splitlines()[0][:200]
        raise ConfigError(f"{path}: not a loadable fairseq checkpoint ({reason})") from None
    if not isinstance(checkpoint, dict) or "model" not in checkpoint:
        raise ConfigError(f"{path}: not a fairseq checkpoint (no 'model' entry)")
    args = checkpoint.get("args") or (checkpoint.get("cfg") or {}).get("model")
    if args is None:
        raise ConfigError(f"{path}: has neither 'args' nor 'cfg.model'; cannot tell its architecture")
    return (vars(args) if isinstance(args, argparse.Namespace) else dict(args)), checkpoint["model"]


def model_config_from(args: dict[str, Any], state: dict[str, torch.Tensor], path: Path) -> ModelConfig:
    """Our model section for a fairseq transformer, refusing options this model does not have."""
    arch = args.get("arch") or args.get("_name") or ""
    if not arch.startswith("transformer"):
        raise ConfigError(f"{path}: arch '{arch}' is not a fairseq transformer; only transformer* archs convert")

    def same(key: str) -> Any:
        encoder, decoder = args.get(f"encoder_{key}"), args.get(f"decoder_{key}")
        if encoder != decoder:
            raise ConfigError(f"{path}: encoder_{key}={encoder} but decoder_{key}={decoder}; both sides must agree")
        return encoder

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
    return ModelConfig(
        encoder_layers=args.get("encoder_layers", 6),  # fairseq's base_architecture defaults
        decoder_layers=args.get("decoder_layers", 6),
        embed_dim=same("embed_dim"),
        ffn_dim=same("ffn_embed_dim"),
        attention_heads=same("attention_heads"),
        dropout=args.get("dropout", 0.1),
        attention_dropout=args.get("attention_dropout", 0.0),
        activation_dropout=args.get("activation_dropout", 0.0),
        max_positions=min(args.get("max_source_positions", 1024), args.get("max_target_positions", 1024)),
        learned_pos=bool(same("learned_pos")),
        share_all_embeddings=bool(args.get("share_all_embeddings")),
        share_decoder_input_output_embed=bool(args.get("share_decoder_input_output_embed"))
        and not args.get("share_all_embeddings"),
        norm_scheme="pre_ln" if same("normalize_before") else "post_ln",
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


def convert(args: argparse.Namespace) -> ModelConfig:
    source, out = Path(args.fairseq_checkpoint), Path(args.out)
    check_output_dir(out, args.force, SUMMARY, [source])
    fairseq_args, state = read_checkpoint(source)
    cfg = model_config_from(fairseq_args, state, source)
    with staged(out) as staging:
        (staging / TAG).mkdir()
        write_layers(cfg, state, staging / TAG, source)
        (staging / LATEST).write_text(TAG)
        (staging / CONFIG_FILE).write_text(json.dumps({"model": model_section(cfg)}, indent=2) + "\n")
        (staging / SUMMARY).write_text(json.dumps({"converted_from": str(source.resolve())}, indent=2) + "\n")
    return cfg


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_config_error():
        cfg = convert(args)
    print(
        f"wrote {args.out}: fairseq transformer as {cfg.norm_scheme}, {cfg.encoder_layers}L-{cfg.decoder_layers}L, "
        f"d={cfg.embed_dim}; start a run from it with --override train.init_from={args.out}"
    )
