"""The flags the decoding commands (scripts/translate.py, scripts/generate.py, the translation benchmark)
share: one per SearchConfig field, and those that choose a checkpoint, its data, the device and precision."""

from __future__ import annotations

import argparse
import dataclasses

from fathom.common.sections import check_field
from fathom.model.model_config import DTYPES
from fathom.model.search import SearchConfig
from fathom.translation.translator import Translator


def option_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_search_args(parser: argparse.ArgumentParser) -> None:
    """One flag per SearchConfig field: --max-len-a for max_len_a, of the default's type, with the field's
    default and its metadata "help"."""
    for setting in dataclasses.fields(SearchConfig):
        parser.add_argument(
            option_name(setting.name),
            type=type(setting.default),
            default=setting.default,
            help=setting.metadata.get("help"),
        )


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The options that choose a checkpoint, its data directory, the device and the search."""
    parser.add_argument("--checkpoint", required=True, help="train.save_dir of a run")
    parser.add_argument("--tag", default=None, help="checkpoint tag, e.g. best or global_step4000 (default: latest)")
    parser.add_argument("--data", required=True, help="the run's data directory (scripts/prepare_data.py)")
    add_search_args(parser)
    parser.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if there is one)")
    parser.add_argument("--precision", choices=DTYPES, default="fp32", help="of the weights (log-probs in fp32)")


def search_config(args: argparse.Namespace) -> SearchConfig:
    """The search settings of a command line, each checked against its field's bounds under its flag."""
    for setting in dataclasses.fields(SearchConfig):
        check_field(setting, getattr(args, setting.name), option_name(setting.name))
    return SearchConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SearchConfig)})


def command_line_translator(args: argparse.Namespace, search_cfg: SearchConfig) -> Translator:
    """The Translator add_model_args' options choose, with `search_cfg` (search_config(args), checked)."""
    return Translator.from_checkpoint(args.checkpoint, args.data, args.tag, args.device, args.precision, search_cfg)
