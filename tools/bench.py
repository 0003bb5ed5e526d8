"""Training throughput on this machine's CPU or one GPU, in one process: the matmul peak at the chosen
precision, our model in a plain PyTorch loop, and optionally torchscale's EncoderDecoder (same config and
loop), DeepSpeed's pipeline engine at 1 stage (same model and batch), our loop compiled, or in pure bf16
(bf16-weights). How each is measured: tools/training_speed.py.

    python scripts/bench.py --layers 6 --dim 512 --ffn 2048 --heads 8 --vocab 8000 --batch 8 \\
        --src-len 64 --tgt-len 64 --precision fp32 --compare torchscale,deepspeed [--depths 12,50] [--json OUT]
    python scripts/bench.py --device cuda --precision autocast --compare bf16-weights,torchscale,deepspeed
    python scripts/bench.py --layers 12 --dim 256 --ffn 1024 --stage-times 2,4   # balance of the stages
    python scripts/bench.py --profile --layers 25 --dim 16 --ffn 64 --heads 2 --vocab 64 --batch 8 \\
        --src-len 6 --tgt-len 6 --micro-batches 4 --checkpoint-interval 1 --scheme deepnorm --rounds 3 --threads 1
    python scripts/bench.py --summarize /tmp/gpu_check   # the table of a scripts/gpu_check.sh run

--profile: where a deep, narrow step's time goes, the engine against a plain loop, per layer and
micro-batch (tools/step_profile.py).

bf16 needs a CPU with native bf16 matmuls (AVX512_BF16 or AMX); elsewhere torch emulates them, about
50x slower than fp32, and a 2048 x 2048 bf16 matmul alone takes about a minute (--matmul-sizes 1024).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import deepspeed
import torch

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, check_counts, check_number, exit_on_config_error, int_list
from fathom.common.files import write_atomic
from fathom.common.heap import set_training_heap
from fathom.common.machine import native_bf16_cpu
from fathom.common.outputs import check_writable_file
from fathom.common.tables import aligned
from fathom.model.model_config import NUM_SPECIAL, ModelConfig
from fathom.model.model_section import model_section
from fathom.pipeline.config.run_config import TrainConfig
from fathom.tools import step_profile
from fathom.tools.gpu_check_report import gpu_check_summary
from fathom.tools.stage_balance import StageTime, stage_times
from fathom.tools.step_profile import ProfileBench, StepProfile
from fathom.tools.timed_steps import synthetic_batch
from fathom.tools.training_speed import PEERS, PRECISIONS, Bench, Result, check, matmul_peak, run, with_peak


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser(__doc__)
    depth = parser.add_mutually_exclusive_group()
    depth.add_argument("--layers", type=int, default=6, help="encoder layers = decoder layers (default 6)")
    depth.add_argument(
        "--depths", type=int_list, help="depth scaling: each of these as encoder = decoder layers, e.g. 12,50,100"
    )
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000, help="source and target vocabulary (separate tables)")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--scheme", default="post_ln", help="model.norm_scheme (torchscale: post_ln, pre_ln, ...)")
    parser.add_argument("--batch", type=int, default=8, help="sentence pairs per step")
    parser.add_argument("--src-len", type=int, default=64, help="source tokens per sentence, eos included")
    parser.add_argument("--tgt-len", type=int, default=64, help="target tokens per sentence, eos included")
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="autocast: fp32 weights, forward under torch.autocast to bf16 (the engine: bf16 as training)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument(
        "--share-all-embeddings", action="store_true", help="one table for source, target and output projection"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=1, help="the systems take turns this many times")
    parser.add_argument(
        "--compare",
        default="",
        help=f"comma-separated of {', '.join(PEERS)} (compiled: our layers under torch.compile; bf16-weights: "
        "our loop in pure bf16 whatever --precision)",
    )
    parser.add_argument("--matmul-sizes", type=int_list, default=(1024, 2048), help="square matmuls for the peak")
    parser.add_argument("--threads", type=int, help="torch threads for every measurement (default: torch's)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--stage-times",
        type=int_list,
        help="instead: forward + backward time of each pipeline stage at these stage counts, e.g. 2,4",
    )
    mode.add_argument(
        "--profile", action="store_true", help="instead: engines against plain loops per layer (see above)"
    )
    mode.add_argument("--summarize", type=Path, metavar="DIR", help="instead: the table of a gpu_check.sh run")
    parser.add_argument("--micro-batches", type=int, default=4, help="--profile: micro-batches per step (default 4)")
    parser.add_argument(
        "--checkpoint-interval",
        type=int,
        default=1,
        help="--profile: the engine's activation checkpointing every this many layers, 0 none (default 1)",
    )
    parser.add_argument(
        "--systems",
        type=lambda text: tuple(text.split(",")),
        default=(),
        help=f"--profile: comma-separated of {', '.join(step_profile.SYSTEMS)} (default: all but engine-compiled)",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        help="--profile: also write each system's profiled step to DIR as a Chrome trace (SYSTEM-DEPTHL.json.gz)",
    )
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Every number in range, before anything is built or timed."""
    check_counts({
        "--layers": args.layers, "--dim": args.dim, "--ffn": args.ffn, "--heads": args.heads, "--batch": args.batch,
        "--src-len": args.src_len, "--tgt-len": args.tgt_len, "--steps": args.steps, "--rounds": args.rounds,
        "--threads": args.threads, "--micro-batches": args.micro_batches,
    })  # fmt: skip
    check_number("--checkpoint-interval", args.checkpoint_interval, 0, what=" (0: none)")
    for option, values in {"--depths": args.depths or (), "--matmul-sizes": args.matmul_sizes}.items():
        for value in values:
            check_number(option, value, 1)
    check_number("--warmup", args.warmup, 0)
    check_number("--vocab", args.vocab, NUM_SPECIAL + 1, what=f" ({NUM_SPECIAL} special symbols and a word)")
    if not 0 <= args.dropout < 1:  # also NaN
        raise ConfigError(f"--dropout: must be in [0, 1), got {args.dropout}")
    layers = 2 * (args.depths or (args.layers,))[0]  # a stage holds at least one Transformer layer
    for stages in args.stage_times or ():
        check_number("--stage-times", stages, 1, layers, what=" (the Transformer layers)")
    if args.stage_times and args.device != "cpu":
        raise ConfigError(f"--device {args.device}: --stage-times times the stages on the CPU; leave --device out")
    if args.profile and args.compare:
        raise ConfigError("--compare: --profile times its own systems (plain loops and engines); leave --compare out")
    for option, value in {"--systems": args.systems, "--trace": args.trace}.items():
        if value and not args.profile:
            raise ConfigError(f"{option}: an option of --profile; add --profile or leave {option} out")


def model_of(args: argparse.Namespace) -> ModelConfig:
    depth = (args.depths or (args.layers,))[0]
    return ModelConfig(
        encoder_layers=depth, decoder_layers=depth, embed_dim=args.dim, ffn_dim=args.ffn, attention_heads=args.heads,
        dropout=args.dropout, norm_scheme=args.scheme, src_vocab_size=args.vocab, tgt_vocab_size=args.vocab,
        share_all_embeddings=args.share_all_embeddings,
    )  # fmt: skip


def shared_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What the throughput bench and the profile both read off the command line."""
    return {
        "model": model_of(args), "batch": args.batch, "src_len": args.src_len, "tgt_len": args.tgt_len,
        "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds, "device": args.device,
    }  # fmt: skip


def bench_of(args: argparse.Namespace) -> Bench:
    peers = tuple(p for p in args.compare.split(",") if p)
    return Bench(**shared_settings(args), depths=args.depths or (args.layers,), peers=peers, precision=args.precision)


def profile_bench_of(args: argparse.Namespace) -> ProfileBench:
    return ProfileBench(
        **shared_settings(args),
        micro_batches=args.micro_batches,
        checkpoint_interval=args.checkpoint_interval,
        precision="fp32" if args.precision == "fp32" else "bf16",  # the profile's bf16 is autocast already
        systems=args.systems,
        trace=args.trace,
    )


COLUMNS = ("system", "layers", "step ms", "tgt tok/s", "GFLOP/s", "of peak", "vs fathom", "ms/layer", "vs shallowest")


def versus_fathom(r: Result) -> str:
    if r.fathom_speedup is not None:
        return f"fathom x{r.fathom_speedup:.2f}"
    if r.engine_overhead is not None:
        return f"overhead {r.engine_overhead:+.1%}"
    if r.compile_speedup is not None:
        return f"x{r.compile_speedup:.2f} eager"
    if r.bf16_speedup is not None:
        return f"x{r.bf16_speedup:.2f} fathom"
    return ""


def table(results: list[Result]) -> str:
    rows = [list(COLUMNS)] + [
        [
            r.system,
            f"{r.depth}-{r.depth}",
            f"{r.step_s * 1e3:.1f}",
            f"{r.tokens_per_s:.0f}",
            f"{r.flops_per_s / 1e9:.2f}",
            f"{r.peak_fraction:.1%}",
            versus_fathom(r),
            f"{r.per_layer_s * 1e3:.2f}",
            f"x{r.per_layer_vs_shallowest:.2f}",
        ]
        for r in results
    ]
    return aligned(rows)


PROFILE_COLUMNS = (
    "system", "layers", "step ms", "host ms", "GPU ms", "GPU busy", "aten ops", "launches", "vs plain",
)  # fmt: skip


def profile_table(profiles: list[StepProfile], cuda: bool) -> str:
    """One row per system and depth; host ms, GPU ms, aten ops and launches are per layer and micro-batch."""
    plain = {p.depth: p for p in profiles if p.system == "plain"}
    rows = [list(PROFILE_COLUMNS)] + [
        [
            p.system,
            f"{p.depth}-{p.depth}",
            f"{p.step_s * 1e3:.1f}",
            f"{p.per_layer(p.step_s) * 1e3:.3f}",
            f"{p.per_layer(p.kernel_s) * 1e3:.3f}" if cuda else "-",
            f"{p.kernel_s / p.step_s:.1%}" if cuda else "-",
            f"{p.per_layer(p.aten_ops):.0f}",
            f"{p.per_layer(p.kernel_launches):.0f}" if cuda else "-",
            f"x{p.step_s / plain[p.depth].step_s:.2f}" if p.system != "plain" else "",
        ]
        for p in profiles
    ]
    return aligned(rows)


def stage_table(stages: int, times: list[StageTime]) -> str:
    mean = sum(t.step_s for t in times) / len(times)
    lines = [f"{stages} stages: slowest / mean = {max(t.step_s for t in times) / mean:.3f}"]
    lines += [
        f"  stage {t.stage}: layers {t.start}-{t.stop - 1}, {t.params:,} parameters, {t.step_s * 1e3:.1f} ms"
        for t in times
    ]
    return "\n".join(lines)


def header(device: str, threads: int) -> str:
    where = (
        f"GPU {torch.cuda.get_device_name(device)}"
        if device.startswith("cuda")
        else f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"bf16 matmuls {'native' if native_bf16_cpu() else 'emulated (no avx512_bf16 or amx_bf16)'}"
    )
    return f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, {threads} threads, {where}"


def profile(args: argparse.Namespace, bench: ProfileBench) -> list[StepProfile]:
    """Every depth's profile, then their table."""
    results = []
    for depth in args.depths or (args.layers,):
        results += step_profile.profile_systems(step_profile.at_depth(bench, depth))
    print(
        f"per Transformer layer and micro-batch: host ms (step / layers / micro-batches), GPU ms (kernels), aten "
        f"ops, kernel launches; engine: ZeRO-1, checkpointing every {bench.checkpoint_interval} layers"
    )
    print(profile_table(results, cuda=bench.device.startswith("cuda")))
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_config_error():
        if args.summarize:
            print(gpu_check_summary(args.summarize))
            return
        check_args(args)
        if args.profile:
            bench = profile_bench_of(args)
            step_profile.check(bench)
        else:
            bench = bench_of(args)
            check(bench)
        if args.json:
            check_writable_file(args.json, "--json")
    deepspeed.utils.logger.setLevel(logging.WARNING)  # its config dump would bury the table
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cpu":  # every system with the heap scripts/train.py trains with by default
        set_training_heap(TrainConfig.cpu_heap)
    threads = torch.get_num_threads()
    print(header(args.device, threads), flush=True)
    if args.stage_times:
        batch = synthetic_batch(bench.model.src_vocab_size, bench.batch, bench.src_len, bench.tgt_len)
        for stages in args.stage_times:
            print(stage_table(stages, stage_times(bench.model, stages, batch, bench.warmup, bench.steps)), flush=True)
        return
    record = {
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "threads": threads,
        "device": args.device,
        "gpu": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
        "native_bf16": native_bf16_cpu(),
        "bench": {**dataclasses.asdict(bench), "model": model_section(bench.model)},
    }
    if args.profile:
        record["results"] = [dataclasses.asdict(p) for p in profile(args, bench)]
    else:
        # Measured before and after: on a shared machine a slow spell would otherwise understate it.
        peak = matmul_peak(bench.dtype, args.matmul_sizes, bench.warmup, bench.steps, bench.device)
        results = run(bench)
        peak = max(peak, matmul_peak(bench.dtype, args.matmul_sizes, bench.warmup, bench.steps, bench.device))
        with_peak(results, peak)
        matmuls = "fp32" if args.precision == "fp32" else "bf16"
        print(f"matmul peak {matmuls}: {peak / 1e9:.2f} GFLOP/s (best of sizes {args.matmul_sizes}, before and after)")
        print(table(results))
        record.update(matmul_sizes=args.matmul_sizes, matmul_peak_flops=peak)
        record["results"] = [dataclasses.asdict(r) for r in results]
    if args.json:
        with exit_on_config_error():
            write_atomic(args.json, json.dumps(record, indent=2) + "\n")
