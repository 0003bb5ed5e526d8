"""A checkpoint as one consolidated state dict: what DeepSpeed's zero_to_fp32.py promises, for fathom's runs.

    python scripts/zero_to_fp32.py SAVE_DIR OUTPUT_DIR [--tag TAG] [--dtype fp32|fp16|bf16]
    python SAVE_DIR/zero_to_fp32.py SAVE_DIR OUTPUT_DIR [--tag TAG]          # the same, from the run
    python SAVE_DIR/zero_to_torch.py SAVE_DIR OUTPUT_DIR --dtype fp16 [--tag TAG]

OUTPUT_DIR/pytorch_model.bin gets the whole model's weights as one state dict under fairseq's names
(encoder.layers.N.self_attn.q_proj.weight, ..., a shared table under each of its names as fairseq saves
it), loadable with torch.load(..., weights_only=True) and no DeepSpeed. They are the trained model's own,
BranchNorm's or DeepNorm's scalings unfolded: for a plain fairseq checkpoint, scripts/convert_to_fairseq.py.
Those of a bf16 or fp16 run are the optimizer's fp32 master weights (pipeline/checkpoint/masters.py), not
the 16-bit copies in its layer files.

DeepSpeed copies its own zero_to_fp32.py and zero_to_torch.py into every save_dir; they read the weights
from mp_rank_00_model_states.pt, where a pipeline checkpoint has none (`module` is None: the weights are in
the layer_*-model_states.pt files), and fail. fathom's saves write recovery_script.py there under both
names instead (write_recovery_scripts), which runs this with DeepSpeed's arguments.
"""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, exit_on_config_error
from fathom.common.files import save_file, unique_sibling, write_atomic
from fathom.common.outputs import check_files_folder
from fathom.common.run_layout import DEEPSPEED_SCRIPTS, checkpoint_dir
from fathom.model.model_config import DTYPES
from fathom.model.trained import fairseq_state_dict, load_reference, missing_layer_files, model_config
from fathom.pipeline.checkpoint.masters import master_weights

WEIGHTS_FILE = "pytorch_model.bin"  # DeepSpeed's name for an unsharded state dict
# DeepSpeed's spellings of the output precision (zero_to_torch.py --dtype)
DTYPE_NAMES = {**{name: name for name in DTYPES}, "float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def parse_args(argv: list[str] | None, dtype_required: bool) -> argparse.Namespace:
    """DeepSpeed's zero_to_fp32.py arguments (zero_to_torch.py's with `dtype_required`)."""
    parser = command_parser(__doc__)
    parser.add_argument("checkpoint_dir", help="train.save_dir of a run")
    parser.add_argument("output_dir", help=f"directory to write {WEIGHTS_FILE} into (made if missing)")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step1 (default: latest)")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPE_NAMES), required=dtype_required, default=None if dtype_required else "fp32"
    )
    # DeepSpeed's options for what fathom does not write: refused in one line rather than ignored.
    parser.add_argument("--max_shard_size", default=None, help="not supported: fathom writes one file")
    parser.add_argument("--safe_serialization", action="store_true", help="not supported: fathom writes torch's format")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="no effect: nothing is frozen")
    parser.add_argument("-d", "--debug", action="store_true", help="no effect")
    return parser.parse_args(argv)


def check_supported(args: argparse.Namespace) -> None:
    if args.max_shard_size is not None:
        raise ConfigError(f"--max_shard_size: fathom writes the state dict as one file, {WEIGHTS_FILE}; leave it out")
    if args.safe_serialization:
        raise ConfigError(f"--safe_serialization: fathom writes torch's format ({WEIGHTS_FILE}); leave it out")


def consolidate(save_dir: Path, tag: str | None, out: Path, dtype: str) -> dict[str, object]:
    """Writes out/WEIGHTS_FILE whole or not at all (a file of that name is replaced); returns what it wrote."""
    cfg = model_config(save_dir)
    checkpoint = checkpoint_dir(save_dir, tag)
    missing_layer_files(cfg, checkpoint)
    check_files_folder(out, "output_dir")
    precision = DTYPES[DTYPE_NAMES[dtype]]
    model = load_reference(save_dir, checkpoint.name)
    masters = master_weights(cfg, checkpoint)
    for part, weights in (masters or {}).items():
        for key, values in weights.items():
            parameter = model.get_submodule(part).get_parameter(key)
            parameter.data.copy_(values.view_as(parameter))
    state = {
        key: value.to(precision) if value.is_floating_point() else value
        for key, value in fairseq_state_dict(model).items()
    }
    made = [folder for folder in (out, *out.parents) if not folder.exists()]  # deepest first
    out.mkdir(parents=True, exist_ok=True)
    path, partial = out / WEIGHTS_FILE, unique_sibling(out / WEIGHTS_FILE)
    try:
        try:
            save_file(state, partial)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    except BaseException as err:  # a full disk or Ctrl-C: nothing of this command's is left
        for folder in made:
            try:
                folder.rmdir()  # refused for one that is not empty: never another's files
            except OSError:
                break
        if isinstance(err, OSError):  # torch's writer fails at close, naming no file, or the hidden partial one
            raise OSError(err.errno, err.strerror, str(path)) from None
        raise
    parameters = sum({value.data_ptr(): value.numel() for value in state.values()}.values())
    source = "the optimizer's fp32 master weights" if masters else "the weights"
    return {"path": path, "checkpoint": checkpoint, "parameters": parameters, "dtype": DTYPE_NAMES[dtype],
            "source": source}  # fmt: skip


def write_recovery_scripts(save_dir: str) -> None:
    """What fathom's saves write where DeepSpeed would copy its zero_to_fp32.py and zero_to_torch.py:
    recovery_script.py under both names, executable, as DeepSpeed leaves its own."""
    text = Path(__file__).with_name("recovery_script.py").read_text()
    for name in DEEPSPEED_SCRIPTS:
        path = Path(save_dir) / name
        write_atomic(path, text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def main(argv: list[str] | None = None, dtype_required: bool = False) -> None:
    args = parse_args(argv, dtype_required)
    with exit_on_config_error():
        check_supported(args)
        written = consolidate(Path(args.checkpoint_dir), args.tag, Path(args.output_dir), args.dtype)
    print(
        f"wrote {written['path']}: {written['checkpoint']}, {written['parameters']:,} parameters in "
        f"{written['dtype']} under fairseq's names, from {written['source']}"
    )
