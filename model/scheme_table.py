"""Prints the norm-scheme registry as a Markdown table; docs/SCHEMES.md's table is this output.

    python scripts/list_schemes.py

The parameters a scheme adds or drops are read off a model built with it, not written by hand.
"""

from __future__ import annotations

import re

from fathom.common.cli import command_parser
from fathom.common.tables import markdown_table
from fathom.model import SCHEMES, ModelConfig, Transformer

COLUMNS = ("scheme", "residual", "initialization", "parameters vs. Post-LN", "plain fairseq Transformer", "source")


def module_names(scheme: str) -> set[str]:
    """Parameterized modules of a 1L-1L model, with sides, layer indices and sublayer kinds folded."""
    cfg = ModelConfig(
        encoder_layers=1, decoder_layers=1, embed_dim=8, ffn_dim=16, attention_heads=1, norm_scheme=scheme,
        src_vocab_size=8, tgt_vocab_size=8,
    )  # fmt: skip
    names = set()
    for name in Transformer(cfg).state_dict():
        module, _, leaf = name.rpartition(".")
        module = re.sub(r"^(en|de)coder\.layer_norm$", "final layer_norm", module)
        module = re.sub(r"^(en|de)coder\.layers\.0\.", "", module)
        module = re.sub(r"^\w+_(residual|layer_norm)$", r"*_\1", module)
        names.add(f"{module}.{leaf}" if leaf not in ("weight", "bias") or module.endswith("residual") else module)
    return names


def parameter_changes(scheme: str) -> str:
    base, own = module_names("post_ln"), module_names(scheme)
    changes = [f"+ `{n}`" for n in sorted(own - base)] + [f"- `{n}`" for n in sorted(base - own)]
    return ", ".join(changes) or "none"


def registry_table() -> str:
    rows = [
        (f"`{s.name}`", s.formula, s.initialization, parameter_changes(s.name), s.fairseq_export, s.source)
        for s in SCHEMES.values()
    ]
    return markdown_table(COLUMNS, rows)


def main(argv: list[str] | None = None) -> None:
    command_parser(__doc__).parse_args(argv)
    print(registry_table())
