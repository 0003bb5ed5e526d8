"""The table of a scripts/gpu_check.sh run (scripts/bench.py --summarize DIR): what each of its pieces
(the benchmarks, the step profile, the 500-layer run, tests/test_gpu.py) measured, or how it failed.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from fathom.common.errors import ConfigError
from fathom.common.jsonl import read_jsonl
from fathom.common.run_layout import CONFIG_FILE, METRICS_FILE
from fathom.common.tables import markdown_table

SUMMARY_SYSTEMS = ("fathom", "bf16-weights", "torchscale", "deepspeed")  # gpu_check.sh's bench columns


def host(profile: dict[str, Any]) -> str:
    """A profiled system's host time per layer and micro-batch (a StepProfile as its JSON has it)."""
    return f"{profile['step_s'] / profile['layer_passes'] * 1e3:.3f} ms"


def busy(profile: dict[str, Any]) -> str:
    """The fraction of a profiled system's step the GPU spent running kernels."""
    return f"{profile['kernel_s'] / profile['step_s']:.1%}"


def gpu_check_summary(out: Path) -> str:
    """scripts/gpu_check.sh's results in `out` as one markdown table: each bench shape's tokens/s and MFU
    (of the matmul peak) per system, the profile's host ms per layer and micro-batch and GPU-busy
    fraction, the 500L run's seconds per step and tests/test_gpu.py's outcome. Every piece shows its
    exit status where it failed (124: its timeout)."""
    if not out.is_dir():
        raise ConfigError(f"--summarize {out}: not a directory; name the OUT_DIR scripts/gpu_check.sh wrote")

    def status(name: str) -> str:
        rc = out / f"{name}.rc"
        code = rc.read_text().strip() if rc.exists() else "not run"
        return "" if code == "0" else f"exit {code}"

    rows = [["check", "fathom / plain", "bf16-weights", "torchscale", "engine", "engine / plain"]]
    for rc in sorted(out.glob("bench*.rc")):
        if not (result := rc.with_suffix(".json")).exists():
            rows.append([rc.stem, status(rc.stem), "", "", "", ""])
            continue
        record = json.loads(result.read_text())
        model, by_system = record["bench"]["model"], {r["system"]: r for r in record["results"]}
        cells = [
            f"{r['tokens_per_s']:,.0f} tok/s, MFU {r['peak_fraction']:.1%}" if (r := by_system.get(s)) else "-"
            for s in SUMMARY_SYSTEMS
        ]
        ratio = (
            f"x{by_system['deepspeed']['step_s'] / by_system['fathom']['step_s']:.2f}"
            if "deepspeed" in by_system
            else ""
        )
        shape = f"{model['encoder_layers']}L-{model['decoder_layers']}L d{model['embed_dim']} ffn{model['ffn_dim']}"
        rows.append([f"bench {shape} batch {record['bench']['batch']}", *cells, ratio])
    profile = out / "profile.json"
    profiles = json.loads(profile.read_text())["results"] if profile.exists() else []
    for depth in sorted({r["depth"] for r in profiles}):
        by_system = {r["system"]: r for r in profiles if r["depth"] == depth}
        plain, engine = by_system["plain"], by_system["engine"]
        name = f"profile {depth}L-{depth}L"

        vs_plain = {system: f"x{r['step_s'] / plain['step_s']:.2f}" for system, r in by_system.items()}
        others = {"engine-deepspeed": "DeepSpeed's settings", "plain-checkpointed": "plain checkpointed"}
        ratio = vs_plain["engine"]
        if aside := [f"{what} {vs_plain[s]}" for s, what in others.items() if s in by_system]:
            ratio += f" ({'; '.join(aside)})"
        for system, what in (("engine-compiled", "compiled"), ("engine-graphed", "CUDA graphs")):
            if r := by_system.get(system):
                ratio += f"; {what} {vs_plain[system]}, {host(r)}, GPU busy {busy(r)}"
        rows += [[f"{name}: host / layer / micro-batch", host(plain), "", "", host(engine), ratio]]
        rows += [[f"{name}: GPU busy", busy(plain), "", "", busy(engine), ""]]
    if not profile.exists():
        rows.append(["profile", status("profile"), "", "", "", ""])
    run_dir = out / "run500"
    # A step's own time is its tokens over its tokens/s; the first two steps warm up.
    metrics, config = run_dir / METRICS_FILE, run_dir / CONFIG_FILE
    steps = read_jsonl(metrics) if metrics.exists() else []
    seconds = [r["tokens"] / r["tokens_per_s"] for r in steps if "tokens_per_s" in r]
    steady = seconds[2:] or seconds
    model = json.loads(config.read_text())["model"] if config.exists() else None
    what = f"train {model['encoder_layers']}L-{model['decoder_layers']}L, 1 GPU" if model else "train500"
    cell = f"{statistics.median(steady):.2f} s/step (median of {len(steady)})" if steady else ""
    train_log = out / "train500.txt"
    # A run stopped before its first save leaves no run directory: its log says how far it got.
    if not steady and train_log.exists():
        if logged := re.findall(r"^step (\d+/\d+) ", train_log.read_text(), re.MULTILINE):
            cell = f"stopped after step {logged[-1]}"
    rows.append([what, "", "", "", " ".join(filter(None, (cell, status("train500")))), ""])
    test_log = out / "test_gpu.txt"
    last = test_log.read_text().strip().splitlines()[-1:] if test_log.exists() else []
    rows.append(["tests/test_gpu.py", "", "", "", " ".join(filter(None, (*last, status("test_gpu")))), ""])
    return markdown_table(rows[0], rows[1:])
