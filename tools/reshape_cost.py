"""What a resume on another shape costs: a run trained for one step at 2 stages, resumed at 1 stage, then at 2
again, each resume converting the latest checkpoint to DeepSpeed's universal form first
(pipeline/checkpoint/reshape.py).

    python scripts/bench_reshape.py --config ds_configs/branchnorm_500L.json --work /tmp/reshape500 --json out.json

For each direction it reports the conversion alone (the command fathom's rank 0 runs, timed with the peak
memory of its process tree) and the whole resume launch (conversion, load, one step, save), with the sizes of
the checkpoint and of its universal form.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, check_number, exit_on_config_error
from fathom.common.files import write_atomic
from fathom.common.machine import cpu
from fathom.common.outputs import check_writable_file
from fathom.common.run_layout import latest_tag, step_tag, universal_tag
from fathom.common.tables import markdown_table
from fathom.pipeline.checkpoint.reshape import converter_command
from fathom.tools.process_sampling import Measured, mib, run_sampled

CONVERTED = re.compile(r"fathom: resuming (.*); converted to DeepSpeed's universal form in ([\d.]+) s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser(__doc__)
    parser.add_argument("--config", default="branchnorm_500L", help="a shipped config's name or a config file")
    parser.add_argument("--work", required=True, help="an empty or missing directory for the run")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--port", type=int, default=29533, help="the launcher's --master_port")
    return parser.parse_args(argv)


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def launch(args: argparse.Namespace, name: str, stages: int, step: int, resume: bool) -> Measured:
    run = Path(args.work) / "run"
    command = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", str(stages), "--master_port", str(args.port),
               "--module", "fathom.train", "--config", args.config, "--override", f"pipeline.stages={stages}",
               f"train.max_steps={step}", "train.save_interval=1", f"train.save_dir={run}"]  # fmt: skip
    return run_sampled(name, command + (["--resume"] if resume else []), Path(args.work) / f"{name}.log")


def convert_alone(args: argparse.Namespace, name: str) -> tuple[Measured, int, int]:
    """The conversion of the latest checkpoint into a scratch folder; with the checkpoint's and its form's bytes."""
    run = Path(args.work) / "run"
    checkpoint, out = run / latest_tag(run), Path(args.work) / f"{name}-universal"
    shutil.rmtree(out, ignore_errors=True)
    measured = run_sampled(name, converter_command(checkpoint, out), Path(args.work) / f"{name}.log")
    sizes = size(checkpoint), size(out)
    shutil.rmtree(out)
    return measured, *sizes


def direction(args: argparse.Namespace, name: str, stages: int, step: int) -> dict:
    alone, checkpoint_bytes, universal_bytes = convert_alone(args, f"convert-{name}")
    resumed = launch(args, f"resume-{name}", stages, step, resume=True)
    said = CONVERTED.search(Path(resumed.log).read_text())
    if said is None:
        raise SystemExit(f"bench_reshape: {resumed.log} has no 'resuming ... converted' line; the run did not reshape")
    run = Path(args.work) / "run"
    assert not (run / universal_tag(step_tag(step - 1))).exists(), "the universal copy outlived the save"
    return {
        "reshape": said[1],
        "conversion_in_run_s": float(said[2]),
        "conversion_alone_s": alone.seconds,
        "conversion_peak_rss": alone.peak_rss,
        "checkpoint_bytes": checkpoint_bytes,
        "universal_bytes": universal_bytes,
        "resume_launch_s": resumed.seconds,
        "resume_launch_peak_rss": resumed.peak_rss,
    }


def run(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    if work.exists() and any(work.iterdir()):
        raise ConfigError(f"--work {work}: is not empty; give a new directory")
    work.mkdir(parents=True, exist_ok=True)
    trained = launch(args, "train-2-stages", 2, 1, resume=False)
    return {
        "cpu": cpu(),
        "config": args.config,
        "train_2_stages_s": trained.seconds,
        "train_2_stages_peak_rss": trained.peak_rss,
        "2_to_1": direction(args, "2-to-1", 1, 2),
        "1_to_2": direction(args, "1-to-2", 2, 3),
    }


def table(results: dict) -> str:
    header = ("reshape", "conversion alone", "its peak RSS (tree)", "checkpoint / universal form",
              "whole resume launch (convert, load, 1 step, save)", "its peak RSS (tree)")  # fmt: skip
    rows = [
        (r["reshape"], f"{r['conversion_alone_s']:.1f} s", mib(r["conversion_peak_rss"]),
         f"{mib(r['checkpoint_bytes'])} / {mib(r['universal_bytes'])}",
         f"{r['resume_launch_s']:.1f} s (conversion {r['conversion_in_run_s']:.1f} s)",
         mib(r["resume_launch_peak_rss"]))
        for r in (results[key] for key in ("2_to_1", "1_to_2"))
    ]  # fmt: skip
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_config_error():
        check_number("--port", args.port, 1, 65535)
        if args.json:
            check_writable_file(Path(args.json), "--json")
        results = run(args)
    if args.json:
        write_atomic(Path(args.json), json.dumps(results, indent=1) + "\n")
    info = results["cpu"]
    print(f"{info['model']}, {info['usable_cores']} cores, avx512_bf16: {info['avx512_bf16']}")
    print(f"trained 1 step at 2 stages in {results['train_2_stages_s']:.1f} s")
    print(table(results))
