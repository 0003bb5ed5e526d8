"""Every numeric option of every command (scripts/*.py) refuses an out-of-range value as docs/DESIGN.md's
"A new command" says a mistake ends, naming the option (`fathom: error: OPTION: ...`), before any work
(reading a corpus, loading a checkpoint, training SentencePiece) and with nothing written.

The table below is checked against the commands themselves: each command's argument parser is walked
for its numeric options (type int, float or common.errors.int_list), and one the table has no case for
fails the coverage test, so a new option cannot be missed silently."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fathom.common.errors import int_list
from tests.helpers import ROOT

SCRIPTS = sorted(path.stem for path in (ROOT / "scripts").glob("*.py"))
SUBCOMMANDS = {"bench_translate": ["depth"]}  # a first argument that selects another parser
COMMANDS = [name for script in SCRIPTS for name in (script, *(f"{script} {s}" for s in SUBCOMMANDS.get(script, ())))]
NUMERIC_TYPES = (int, float, int_list)


def load_main(script: str) -> Callable[[list[str]], None]:
    """The main() a script runs: the script itself loaded as a module (most import a package's main)."""
    spec = importlib.util.spec_from_file_location(f"fathom_script_{script}", ROOT / "scripts" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


# Loaded once at collection: their imports' log lines (DeepSpeed's accelerator) stay out of the cases' stderr.
MAINS = {script: load_main(script) for script in SCRIPTS}

CASE = "<case>"  # where in a command's arguments the option under test goes (the launcher's come first)
BASE = {  # each command's required arguments, pointing into the test's empty tmp_path
    "average_checkpoints": ["--checkpoint", "{tmp}/run", CASE],
    "bench": [CASE],
    "bench_masks": ["--config", "{tmp}/config.json", CASE],
    "bench_prepare": ["--work", "{tmp}/work", "--pairs", "10", CASE],
    "bench_reshape": ["--work", "{tmp}/work", CASE],
    "bench_translate": ["--checkpoint", "{tmp}/run", "--data", "{tmp}/data", CASE],
    "bench_translate depth": ["depth", CASE],
    "compare_training": ["--config", "{tmp}/config.json", CASE],
    "estimate_memory": ["--config", "{tmp}/config.json", CASE],
    "generate": ["--checkpoint", "{tmp}/run", "--data", "{tmp}/data", CASE],
    "launch": [CASE, "scripts/train.py", "--config", "{tmp}/config.json"],
    "plan_cluster": ["--config", "{tmp}/config.json", "--gpu-memory", "80GB", CASE],
    "prepare_data": ["--src", "de", "--tgt", "en", "--train", "{tmp}/train", "--valid", "{tmp}/valid"]
    + ["--vocab-size", "100", "--out", "{tmp}/out", CASE],
    "translate": ["--checkpoint", "{tmp}/run", "--data", "{tmp}/data", "--input", "{tmp}/in.de"]
    + ["--output", "{tmp}/out.en", CASE],
}


@dataclass(frozen=True)
class Case:
    command: str
    option: str
    value: str
    message: str
    context: tuple[str, ...] = ()  # other options the refusal needs
    env: dict[str, str] = field(default_factory=dict)

    def argv(self, tmp: Path) -> list[str]:
        argv = [arg.format(tmp=tmp) for arg in BASE[self.command]]
        at = argv.index(CASE)
        argv[at : at + 1] = [*self.context, self.option, self.value]
        return argv

    @property
    def id(self) -> str:
        return f"{self.command} {self.option} {self.value}"


FINITE = "must be a finite number, got"
SEARCH = [  # the search options every decoding command shares (translation/decoding_flags.py's add_model_args)
    ("--beam", "0", "--beam: must be at least 1, got 0"),
    ("--lenpen", "nan", f"--lenpen: {FINITE} nan"),
    ("--lenpen", "inf", f"--lenpen: {FINITE} inf"),
    ("--max-len-a", "-1", "--max-len-a: must be at least 0, got -1.0"),
    ("--max-len-a", "nan", "--max-len-a: must be a finite number, got nan"),
    ("--max-len-b", "0", "--max-len-b: must be at least 1, got 0"),
    ("--batch-size", "0", "--batch-size: must be at least 1, got 0"),
]
CASES = [
    *(Case(command, *search) for command in ("translate", "generate", "bench_translate") for search in SEARCH),
    Case("prepare_data", "--vocab-size", "7", "--vocab-size: must be at least 8, got 7"),
    Case("prepare_data", "--spm-sample", "0", "--spm-sample: must be at least 1 sentence, got 0"),
    Case("prepare_data", "--spm-seed", "-1", "--spm-seed: must be at least 0, got -1"),
    Case("prepare_data", "--max-len", "0", "--max-len: must be at least 1 piece, got 0"),
    Case("prepare_data", "--max-ratio", "0.5", "--max-ratio: must be at least 1 (sides of equal length), got 0.5"),
    Case("prepare_data", "--max-ratio", "nan", f"--max-ratio: {FINITE} nan"),
    Case("prepare_data", "--max-ratio", "inf", f"--max-ratio: {FINITE} inf"),
    Case("prepare_data", "--workers", "0", "--workers: must be at least 1, got 0"),
    Case("plan_cluster", "--gpus", "0", "--gpus: must be at least 1, got 0"),
    *(Case("plan_cluster", option, "0", f"{option}: must be at least 1, got 0", ("--gpus", "8"))
      for option in ("--gpus-per-node", "--vocab-size", "--stages", "--sentences", "--length")),
    Case("bench_translate", "--sentences", "-1", "--sentences: must be at least 0 (0: the whole split), got -1"),
    Case("bench_translate", "--rounds", "0", "--rounds: must be at least 1, got 0"),
    Case("bench_translate", "--threads", "0", "--threads: must be at least 1, got 0"),
    Case("bench_translate depth", "--depths", "25,0", "--depths: must be at least 1, got 0"),
    Case("bench_translate depth", "--encoder-layers", "0", "--encoder-layers: must be at least 1, got 0"),
    Case("bench_translate depth", "--dim", "0", "--dim: must be at least 4 (one per head), got 0"),
    Case("bench_translate depth", "--dim", "130", "--dim: 130 is not divisible by the 4 heads"),
    Case("bench_translate depth", "--vocab", "4", "--vocab: must be at least 5 (4 special symbols and a word), got 4"),
    Case("bench_translate depth", "--sentences", "0", "--sentences: must be at least 1, got 0"),
    Case("bench_translate depth", "--length", "0", "--length: must be from 1 to 1023"),
    Case("bench_translate depth", "--length", "1024", "--length: must be from 1 to 1023"),
    Case("bench_translate depth", "--beam", "0", "--beam: must be at least 1, got 0"),
    Case("bench_translate depth", "--threads", "0", "--threads: must be at least 1, got 0"),
    Case("bench", "--layers", "0", "--layers: must be at least 1, got 0"),
    Case("bench", "--depths", "12,0", "--depths: must be at least 1, got 0"),
    Case("bench", "--dim", "0", "--dim: must be at least 1, got 0"),
    Case("bench", "--ffn", "0", "--ffn: must be at least 1, got 0"),
    Case("bench", "--heads", "0", "--heads: must be at least 1, got 0"),
    Case("bench", "--vocab", "4", "--vocab: must be at least 5 (4 special symbols and a word), got 4"),
    Case("bench", "--dropout", "1", "--dropout: must be in [0, 1), got 1.0"),
    Case("bench", "--dropout", "-0.1", "--dropout: must be in [0, 1), got -0.1"),
    Case("bench", "--dropout", "nan", "--dropout: must be in [0, 1), got nan"),
    Case("bench", "--batch", "0", "--batch: must be at least 1, got 0"),
    Case("bench", "--src-len", "0", "--src-len: must be at least 1, got 0"),
    Case("bench", "--tgt-len", "0", "--tgt-len: must be at least 1, got 0"),
    Case("bench", "--steps", "0", "--steps: must be at least 1, got 0"),
    Case("bench", "--warmup", "-1", "--warmup: must be at least 0, got -1"),
    Case("bench", "--rounds", "0", "--rounds: must be at least 1, got 0"),
    Case("bench", "--matmul-sizes", "1024,0", "--matmul-sizes: must be at least 1, got 0"),
    Case("bench", "--threads", "0", "--threads: must be at least 1, got 0"),
    Case("bench", "--stage-times", "0", "--stage-times: must be from 1 to 12 (the Transformer layers), got 0"),
    Case("bench", "--stage-times", "2,13", "--stage-times: must be from 1 to 12 (the Transformer layers), got 13"),
    Case("bench", "--micro-batches", "0", "--micro-batches: must be at least 1, got 0"),
    Case("bench", "--checkpoint-interval", "-1", "--checkpoint-interval: must be at least 0 (0: none), got -1"),
    Case("estimate_memory", "--stages", "0", "--stages: must be at least 1, got 0"),
    Case("estimate_memory", "--data-parallel", "0", "--data-parallel: must be at least 1, got 0"),
    Case("estimate_memory", "--sentences", "0", "--sentences: must be at least 1, got 0"),
    Case("estimate_memory", "--length", "0", "--length: must be at least 1, got 0"),
    Case("average_checkpoints", "--last", "1", "--last 1: averaging needs at least 2 checkpoints"),
    Case("compare_training", "--at", "0", "--at: steps start at 1, got 0"),
    Case("compare_training", "--tolerance", "-1", "--tolerance: must be at least 0, got -1.0", ("--at", "1")),
    Case("compare_training", "--tolerance", "nan", "--tolerance: must be a finite number, got nan", ("--at", "1")),
    Case("bench_masks", "--warmup", "-1", "--warmup: must be at least 0, got -1"),
    Case("bench_masks", "--blocks", "0", "--blocks: must be at least 1, got 0"),
    Case("bench_masks", "--steps", "0", "--steps: must be at least 1, got 0"),
    Case("bench_reshape", "--port", "0", "--port: must be from 1 to 65535, got 0"),
    Case("bench_reshape", "--port", "65536", "--port: must be from 1 to 65535, got 65536"),
    # tools/preparation_speed.py's own checks (another change's file): here so that they stay
    Case("bench_prepare", "--pairs", "0", "--pairs: must be at least 1, got 0"),
    Case("bench_prepare", "--vocab-size", "7", "--vocab-size: must be at least 8, got 7"),
    Case("bench_prepare", "--workers", "0", "--workers: must be at least 1, got 0"),
    Case("bench_prepare", "--spm-sample", "0", "--spm-sample: must be at least 1, got 0"),
    # pipeline/launch/command.py's checks of DeepSpeed's launcher options
    Case("launch", "--master_port", "0", "--master_port 0: not a TCP port"),
    Case("launch", "--master_port", "65536", "--master_port 65536: not a TCP port"),
    Case("launch", "--ssh_port", "0", "--ssh_port 0: not a TCP port"),
    Case("launch", "--num_gpus", "0", "--num_gpus 0: must be at least 1, or left out for all"),
    Case("launch", "--num_gpus", "-2", "--num_gpus -2: must be at least 1, or left out for all"),
    Case("launch", "--num_nodes", "0", "--num_nodes 0: must be at least 1, or left out for all"),
    Case("launch", "--node_rank", "-1", "--node_rank -1: with --no_ssh give each launcher its node", ("--no_ssh",),
         {"LOCAL_SIZE": "1"}),  # DeepSpeed counts a CPU's slots with numactl, a process, unless told
]  # fmt: skip

# Numeric options no case refuses, each with the reason.
UNCHECKED = {
    ("bench_masks", "--local_rank"): "set by the deepspeed launcher, not by a user (hidden from --help)",
    ("train", "--local_rank"): "set by the deepspeed launcher, not by a user (hidden from --help)",
}


class Parsed(BaseException):  # not an Exception: no handler on the way up may take it for an error
    """Raised in place of parsing: carries the parser a command built."""


def numeric_options(command: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, type]:
    """The command's options of a numeric type, by each one's first spelling: its parser, caught as its
    main() starts parsing."""

    def capture(parser: argparse.ArgumentParser, *args, **kwargs):
        raise Parsed(parser)

    script, *subcommand = command.split()
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    try:
        MAINS[script](subcommand)
    except Parsed as parsed:
        parser = parsed.args[0]
    else:
        return {}
    finally:
        monkeypatch.undo()
    return {a.option_strings[0]: a.type for a in parser._actions if a.option_strings and a.type in NUMERIC_TYPES}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_numeric_option_has_a_case(command, monkeypatch):
    options = numeric_options(command, monkeypatch)
    cases = [case for case in CASES if case.command == command]
    missing = [o for o in options if (command, o) not in UNCHECKED and not any(c.option == o for c in cases)]
    assert not missing, f"{command}: add a case to CASES for {', '.join(missing)} (or say in UNCHECKED why not)"
    no_nan = [
        o for o, kind in options.items() if kind is float and not any(c.option == o and c.value == "nan" for c in cases)
    ]
    assert not no_nan, f"{command}: a float option must refuse nan; add a case for {', '.join(no_nan)}"
    unknown = [case.option for case in cases if case.option not in options]
    assert not unknown, f"{command}: no numeric option {', '.join(unknown)}; remove its case"


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_number_out_of_range_is_one_line_before_any_work(case, tmp_path, capsys, monkeypatch):
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        MAINS[case.command.split()[0]](case.argv(tmp_path))
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert exc.value.code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith(f"fathom: error: {case.option}") and case.message in lines[0], err
    assert not any(tmp_path.iterdir())  # nothing written, not even a directory
