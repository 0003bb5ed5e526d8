"""The fp32 master weights of a bf16 or fp16 run, read from its checkpoint's ZeRO optimizer files.

Such a run's layer files hold the weights the model computed with, rounded to 16 bits; the weights the
optimizer updates are fp32 copies in `[bf16_]zero_pp_rank_R_mp_rank_SS_optim_states.pt`, one flat
partition per stage SS and data-parallel rank R (`single_partition_of_fp32_groups`), with where each
parameter lies in it (`param_slice_mappings`: name -> the start and length of its piece in that rank's
partition, for the parameters that have one there). A parameter's pieces in rank order are its values,
flattened: DeepSpeed's ds_to_universal puts them together the same way. The names are the pipeline
module's, `INDEX.key` for the layer at INDEX and `tied_modules.TIE.key` for a shared table, which every
stage that uses it keeps a copy of.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from fathom.common.checkpoint_format import OPTIMIZER_FILE, deepspeed_state_types, load_file, model_states
from fathom.model.model_config import ModelConfig
from fathom.model.parts import model_parts
from fathom.pipeline.config.deepspeed_values import precision

# DeepSpeed's keys (deepspeed/checkpoint/constants.py, tests/test_zero_to_fp32.py checks them), written here:
# reading a checkpoint needs no DeepSpeed imported (tests/test_deepspeed_internals.py)
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
TIED = "tied_modules."  # DeepSpeed's PipelineModule keeps shared tables under this name


def pipeline_names(cfg: ModelConfig) -> dict[str, str]:
    """{pipeline module prefix: reference module name} of every part a checkpoint has a layer file for."""
    return {
        f"{TIED}{part.tie}." if part.tie else f"{index}.": part.name
        for index, part in enumerate(model_parts(cfg))
        if part.saved
    }


def split_name(name: str) -> tuple[str, str]:
    """A pipeline parameter name as (its module's prefix in pipeline_names, the parameter's key there)."""
    parts = 3 if name.startswith(TIED) else 2
    *module, key = name.split(".", parts - 1)
    return ".".join(module) + ".", key


def optimizer_files(checkpoint: Path) -> dict[int, list[Path]]:
    """The checkpoint's optimizer files by stage, each stage's in data-parallel rank order."""
    ranked: dict[int, dict[int, Path]] = defaultdict(dict)
    for path in checkpoint.iterdir():
        if match := OPTIMIZER_FILE.fullmatch(path.name):
            replica, stage = map(int, match.groups())
            ranked[stage][replica] = path
    return {stage: [files[replica] for replica in sorted(files)] for stage, files in sorted(ranked.items())}


def stage_masters(files: list[Path]) -> dict[str, torch.Tensor] | None:
    """{pipeline parameter name: its fp32 master, flattened} from one stage's optimizer files; None for
    files without the mappings (written by an optimizer that keeps no fp32 copy apart)."""
    pieces: dict[str, list[torch.Tensor]] = defaultdict(list)
    for path in files:
        state = load_file(path, allowed=deepspeed_state_types())[OPTIMIZER_STATE_DICT]
        if PARAM_SLICE_MAPPINGS not in state or SINGLE_PARTITION_OF_FP32_GROUPS not in state:
            return None
        for partition, mapping in zip(state[SINGLE_PARTITION_OF_FP32_GROUPS], state[PARAM_SLICE_MAPPINGS], strict=True):
            for name, address in mapping.items():
                pieces[name].append(partition.narrow(0, address.start, address.numel))
    return {name: torch.cat(parts) for name, parts in pieces.items()}


def master_weights(cfg: ModelConfig, checkpoint: Path) -> dict[str, dict[str, torch.Tensor]] | None:
    """{reference module name: {parameter key: fp32 master, flattened}} of a 16-bit run's checkpoint; None
    for a checkpoint whose weights are fp32 already (their own masters), or that keeps no masters apart
    (not written by DeepSpeed's engine: an average, weights imported from fairseq)."""
    states = model_states(checkpoint)
    if states is None or precision(states.get("ds_config") or {}) == "fp32":
        return None
    owners = pipeline_names(cfg)
    masters: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for files in optimizer_files(checkpoint).values():
        flat = stage_masters(files)
        if flat is None:
            return None
        for name, values in flat.items():
            prefix, key = split_name(name)
            # a shared table on two stages: both copies are the same (DeepSpeed reduces their gradients)
            masters[owners[prefix]].setdefault(key, values)
    return dict(masters) or None
