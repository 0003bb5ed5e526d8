"""Plots training and validation loss of a run: python scripts/plot_metrics.py SAVE_DIR [--out FILE.png]"""

from __future__ import annotations

import io
from pathlib import Path

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, exit_on_config_error
from fathom.common.figures import pyplot
from fathom.common.files import write_atomic
from fathom.common.jsonl import read_jsonl
from fathom.common.outputs import check_writable_file
from fathom.common.run_layout import LOSS_PLOT, METRICS_FILE


def main(argv: list[str] | None = None) -> None:
    parser = command_parser(__doc__)
    parser.add_argument("run", help="train.save_dir of a run (holds metrics.jsonl)")
    parser.add_argument("--out", default=None, help="image to write, .png, .pdf, .svg, ... (default: RUN/loss.png)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    path = Path(args.run) / METRICS_FILE
    out = Path(args.out or Path(args.run) / LOSS_PLOT)
    with exit_on_config_error():
        plt = pyplot("scripts/plot_metrics.py")
        if not path.is_file():
            raise ConfigError(f"{path}: no such file; pass the train.save_dir of a run")
        records = read_jsonl(path)
        if not any("loss" in r for r in records):
            raise ConfigError(f"{path}: no training step logged yet; plot after the first train.log_interval steps")
        check_writable_file(out, "--out", {"the run's log": path})
        image_format = out.suffix[1:].lower()
        if image_format not in plt.matplotlib.backend_bases.FigureCanvasBase.get_supported_filetypes():
            raise ConfigError(f"--out {out}: not an image file name; end it in .png, .pdf or .svg")
    train = [r for r in records if "loss" in r]
    valid = [r for r in records if "valid_loss" in r]

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8, alpha=0.8, label="train (per step)")
    if valid:
        ax.plot([r["step"] for r in valid], [r["valid_loss"] for r in valid], "o-", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(args.title or Path(args.run).name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format=image_format, dpi=120)
    with exit_on_config_error():
        write_atomic(out, image.getvalue())
    print(f"wrote {out}")
