"""Training throughput of fathom's model, side by side with the machine's matmul peak, torchscale's
EncoderDecoder at the same config, and DeepSpeed's pipeline engine at 1 stage (scripts/bench.py).

Everything runs in one process on one device (the CPU with the same torch threads, or one GPU), on
one fixed batch of `batch` pairs of exactly `src_len` source and `tgt_len` target tokens (no padding,
so every position is work), with the same AdamW and label-smoothed loss. Every timed section runs
`warmup` untimed steps first; a training step's time is the median of the `steps` timed steps of every
round (the systems take turns `rounds` times). On a GPU every timed step ends in a synchronize: the
device's work is timed, not the host's queueing of it.

Precision: fp32, bf16 or autocast. The plain loops (ours and torchscale's) train fp32 in fp32; bf16 as
pure bf16: parameters, gradients and AdamW's state in bf16, no fp32 master weights; autocast as fp32
weights with the forward and loss under torch.autocast to bf16. The "bf16-weights" peer is our plain
loop in pure bf16 whatever the precision, so that one autocast run shows both. DeepSpeed's engine runs
bf16 and autocast as training does (ZeRO-1): bf16 parameters and gradients but fp32 master weights and
optimizer state, so its "overhead" in bf16 includes those fp32 copies and the casts between them. The
matmul peak of bf16 and autocast is bf16's.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import itertools
import json
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import nn

from fathom.common.errors import ConfigError
from fathom.common.jsonl import read_jsonl
from fathom.common.ports import free_port
from fathom.common.tables import markdown_table
from fathom.corpus.batches import MicroBatch, collate
from fathom.model.layers import compile_layers, compiler_missing
from fathom.model.loss import label_smoothed_cross_entropy
from fathom.model.model_config import NUM_SPECIAL, ModelConfig
from fathom.model.norms import build_scheme
from fathom.model.transformer import Transformer
from fathom.pipeline.config.deepspeed_values import check_deepspeed
from fathom.pipeline.config.run_config import DataConfig, RunConfig, TrainConfig
from fathom.pipeline.engine.internals import clear_pipe_buffers
from fathom.pipeline.launch.distributed import release_shm_buffer
from fathom.pipeline.train import build_engine
from fathom.tools.torchscale_peer import TORCHSCALE_SCHEMES, import_torchscale, torchscale_model

PRECISIONS = ("fp32", "bf16", "autocast")  # what the benchmark trains in
# What our plain loop ("fathom") can be compared with; bf16-weights: ours in pure bf16 whatever the precision.
PEERS = ("torchscale", "deepspeed", "compiled", "bf16-weights")
# ds_configs/default.json's optimizer, here for both the plain loops and the engine.
ADAMW = {"lr": 0.001, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.0001, "fused": True}

Step = Callable[[], object]


@dataclass(frozen=True)
class Bench:
    """What to measure. Each depth D trains D encoder and D decoder layers, the rest from `model`."""

    model: ModelConfig
    depths: tuple[int, ...]
    peers: tuple[str, ...]  # of PEERS, each measured after our plain loop at every depth
    batch: int
    src_len: int
    tgt_len: int
    precision: str
    warmup: int
    steps: int
    rounds: int = 1
    device: str = "cpu"

    @property
    def dtype(self) -> torch.dtype:
        """The matmuls' precision, and so the peak's: bf16 for bf16 and autocast."""
        return torch.float32 if self.precision == "fp32" else torch.bfloat16

    @property
    def systems(self) -> tuple[str, ...]:
        return ("fathom", *self.peers)


@dataclass
class Result:
    system: str
    depth: int
    step_s: float  # median
    tokens_per_s: float  # target tokens
    flops_per_s: float  # model FLOPs (model_flops) per second
    per_layer_s: float  # step_s / (2 depth): embeddings and output projection amortized over the layers
    peak_fraction: float = 0.0  # of the matmul peak at the same precision (set by with_peak)
    per_layer_vs_shallowest: float = 1.0  # per_layer_s over this system's at the smallest depth
    fathom_speedup: float | None = None  # torchscale rows: our tokens/s over torchscale's
    engine_overhead: float | None = None  # deepspeed rows: engine step time over our plain loop's, minus 1
    compile_speedup: float | None = None  # compiled rows: our eager step time over the compiled one's
    bf16_speedup: float | None = None  # bf16-weights rows: their tokens/s over our plain loop's


def synchronized(step: Step, device: str) -> Step:
    """`step`, returning only once the device has finished its work: a GPU runs asynchronously, and
    a step timed without this measures the host queueing kernels."""
    if not device.startswith("cuda"):
        return step

    def step_and_wait() -> None:
        step()
        torch.cuda.synchronize(device)

    return step_and_wait


def to_device(batch: MicroBatch, device: str) -> MicroBatch:
    """`batch`'s tensors on `device`."""
    (src_tokens, prev_output_tokens), target = batch
    return (src_tokens.to(device), prev_output_tokens.to(device)), target.to(device)


def time_steps(step: Step, warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` calls of `step`, after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        tick = time.perf_counter()
        step()
        times.append(time.perf_counter() - tick)
    return times


def matmul_peak(dtype: torch.dtype, sizes: tuple[int, ...], warmup: int, repeats: int, device: str = "cpu") -> float:
    """FLOP/s of the fastest torch.mm of two n x n matrices (2 n^3 FLOPs) over `sizes` on `device`: what
    its BLAS reaches at this precision (and on a CPU, thread count), the ceiling for a training step."""
    best = 0.0
    for n in sizes:
        a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
        mm = synchronized(lambda a=a, b=b: torch.mm(a, b), device)
        best = max(best, 2 * n**3 / min(time_steps(mm, warmup, repeats)))
    return best


def model_flops(cfg: ModelConfig, src_len: int, tgt_len: int, batch: int) -> float:
    """FLOPs of one training step (forward + backward) of `batch` pairs without padding, counting
    matrix multiplications only; activation recomputation is not counted (model FLOPs, not hardware).

    A weight matrix of P parameters costs 2 P FLOPs per token it is applied to forward and 4 P
    backward (input and weight gradients): 6 P. Per source token: every encoder layer's q, k, v, out
    (4 d^2) and fc1, fc2 (2 d f), and every decoder layer's cross-attention k, v (2 d^2), which read
    the encoder output. Per target token: every decoder layer's self-attention (4 d^2), cross-attention
    q and out (2 d^2) and FFN (2 d f), and the output projection (V d). Attention scores and their
    weighted sum cost 2 * 2 * (keys) * d per query per attention forward, x 3 with backward; causal
    self-attention is counted over all tgt_len keys. Embedding lookups, biases, LayerNorm, softmax and
    the optimizer are not counted.
    """
    d, f, n, m = cfg.embed_dim, cfg.ffn_dim, cfg.encoder_layers, cfg.decoder_layers
    src_tokens, tgt_tokens = batch * src_len, batch * tgt_len
    params_per_src_token = n * (4 * d * d + 2 * d * f) + m * 2 * d * d
    params_per_tgt_token = m * (6 * d * d + 2 * d * f) + cfg.tgt_vocab_size * d
    weights = 6 * (params_per_src_token * src_tokens + params_per_tgt_token * tgt_tokens)
    attention = 3 * 4 * d * (src_tokens * n * src_len + tgt_tokens * m * (tgt_len + src_len))
    return float(weights + attention)


def synthetic_batch(vocab: int, batch: int, src_len: int, tgt_len: int) -> MicroBatch:
    """`batch` random pairs in the training layout (corpus.batches.collate), every one exactly src_len
    and tgt_len tokens long with eos."""
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(NUM_SPECIAL, vocab, (batch, src_len - 1), generator=gen)
    tgt = torch.randint(NUM_SPECIAL, vocab, (batch, tgt_len - 1), generator=gen)
    return collate(list(zip(src, tgt, strict=True)))


def weights_dtype(precision: str) -> torch.dtype:
    """What a plain loop holds its parameters in: bf16 only for pure bf16 (autocast keeps fp32 weights)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def plain_loop(
    model: nn.Module,
    logits: Callable[..., torch.Tensor],
    batch: MicroBatch,
    precision: str,
    device: str,
    micro_batches: int = 1,
) -> Step:
    """One optimizer step of the single-process training loop: AdamW, label-smoothed loss, gradients
    accumulated over `micro_batches` passes of `batch`. `model` is already on `device` in
    weights_dtype(precision)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
    (src_tokens, prev_output_tokens), target = to_device(batch, device)
    autocast = torch.autocast(torch.device(device).type, torch.bfloat16, enabled=precision == "autocast")

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for _ in range(micro_batches):
            with autocast:
                loss = label_smoothed_cross_entropy(logits(src_tokens, prev_output_tokens), target)
            (loss / micro_batches).backward()
        optimizer.step()

    return synchronized(step, device)


@contextlib.contextmanager
def fathom_step(cfg: ModelConfig, batch: MicroBatch, precision: str, device: str) -> Iterator[Step]:
    model = Transformer(cfg).to(device, weights_dtype(precision)).train()
    yield plain_loop(model, model, batch, precision, device)


@contextlib.contextmanager
def bf16_weights_step(cfg: ModelConfig, batch: MicroBatch, precision: str, device: str) -> Iterator[Step]:
    """Our plain loop in pure bf16 whatever `precision`: beside an autocast run, what bf16 weights save."""
    with fathom_step(cfg, batch, "bf16", device) as step:
        yield step


@contextlib.contextmanager
def compiled_step(cfg: ModelConfig, batch: MicroBatch, precision: str, device: str) -> Iterator[Step]:
    """Our plain loop with every Transformer layer compiled (train.compile); the warmup steps compile."""
    model = Transformer(cfg).to(device, weights_dtype(precision)).train()
    compile_layers(model)
    yield plain_loop(model, model, batch, precision, device)


@contextlib.contextmanager
def torchscale_step(cfg: ModelConfig, batch: MicroBatch, precision: str, device: str) -> Iterator[Step]:
    (src_tokens, prev_output_tokens), _ = batch
    model = torchscale_model(cfg, max(src_tokens.size(1), prev_output_tokens.size(1)) + 2)
    model = model.to(device, weights_dtype(precision)).train()
    yield plain_loop(model, lambda src, prev: model(src, prev)[0], batch, precision, device)


def init_single_process(device: str = "cpu") -> None:
    """torch.distributed for this one process (world size 1; gloo on a CPU, nccl on a GPU), which the
    engine needs. Not pipeline.launched.init_distributed: that one sets torch's thread count for
    launched ranks, and here every system must run with the same threads."""
    if dist.is_initialized():
        return
    # DeepSpeed's engine places itself on its accelerator's device LOCAL_RANK: cuda:N's N.
    local_rank = torch.device(device).index or 0
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
        "LOCAL_RANK": str(local_rank),
    })  # fmt: skip
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        deepspeed.init_distributed(dist_backend="nccl")
        return
    deepspeed.init_distributed(dist_backend="gloo")
    release_shm_buffer()  # DeepSpeed's CPU all-reduce segment in /dev/shm, which it never removes


def deepspeed_config(batch: int, bf16: bool) -> dict[str, Any]:
    """The plain loop's step as a DeepSpeed pipeline config: one stage, one micro-batch per step,
    no activation checkpointing, torch's AdamW, no LR schedule, no gradient clipping. bf16 as training
    runs it: ZeRO-1 (fp32 master weights; fathom refuses bf16 without ZeRO, which cannot resume)."""
    return {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {**ADAMW, "torch_adam": True}},  # Adam type + adam_w_mode: AdamW
        "zero_optimization": {"stage": 1 if bf16 else 0},
        "bf16": {"enabled": bf16},
        "gradient_clipping": 0.0,
        "pipeline": {"stages": 1, "activation_checkpoint_interval": 0},
    }


def deepspeeds_settings(ds: dict[str, Any]) -> dict[str, Any]:
    """`ds` with DeepSpeed's own values where fathom's engine_config picks others; what fathom replaces in
    a built engine, use_deepspeeds_own (tools/step_profile.py) puts back."""
    ds = copy.deepcopy(ds)
    ds.setdefault("zero_optimization", {})["contiguous_gradients"] = True
    ds["timers"] = {"throughput": {"enabled": True}}
    return ds


@contextlib.contextmanager
def built_engine(
    cfg: ModelConfig, ds: dict[str, Any], device: str, deepspeeds: bool = False
) -> Iterator[deepspeed.PipelineEngine]:
    """scripts/train.py's engine of `cfg` with DeepSpeed config `ds` at one stage, in this process, on its
    accelerator's device (init_single_process puts that on `device`); train_batch moves batches there.
    `deepspeeds`: built with DeepSpeed's own values where fathom picks others (deepspeeds_settings), once
    `ds` passed the run's checks, which refuse one of them (the throughput timer) in a config."""
    init_single_process(device)
    check_deepspeed(ds, cfg, world_size=1)
    if deepspeeds:
        ds = deepspeeds_settings(ds)
    # DeepSpeed prints its layer list and bf16 memory reports while it builds the engine: not here.
    with contextlib.redirect_stdout(io.StringIO()):
        engine = build_engine(RunConfig(model=cfg, data=DataConfig(), train=TrainConfig(), deepspeed=ds))
    yield engine
    # The engine keeps the last logits (pipe_buffers) and loss; their autograd graph holds DeepSpeed's
    # backward hooks, which hold the engine: a cycle through C++ that gc cannot see, so every engine
    # (weights, optimizer state) would stay in memory until the process ends.
    clear_pipe_buffers(engine)


@contextlib.contextmanager
def deepspeed_step(cfg: ModelConfig, batch: MicroBatch, precision: str, device: str) -> Iterator[Step]:
    with built_engine(cfg, deepspeed_config(batch[1].size(0), bf16=precision != "fp32"), device) as engine:
        micro_batches = itertools.repeat(batch)
        yield synchronized(lambda: engine.train_batch(data_iter=micro_batches), device)


Builder = Callable[[ModelConfig, MicroBatch, str, str], contextlib.AbstractContextManager[Step]]
BUILDERS: dict[str, Builder] = {
    "fathom": fathom_step,
    "torchscale": torchscale_step,
    "deepspeed": deepspeed_step,
    "compiled": compiled_step,
    "bf16-weights": bf16_weights_step,
}


def check_device(device: str, engine: bool) -> None:
    """`device` is the CPU or a CUDA GPU this machine has; with `engine`, also the device DeepSpeed's
    engine will run on (its accelerator's, chosen when deepspeed is imported)."""
    try:
        kind = torch.device(device)
    except RuntimeError:
        kind = None
    if kind is None or kind.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: not a device here; choose cpu, cuda or cuda:N")
    if kind.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {device}: torch sees no CUDA GPU on this machine; run on one or use --device cpu"
            )
        if (kind.index or 0) >= torch.cuda.device_count():
            raise ConfigError(f"--device {device}: this machine has {torch.cuda.device_count()} GPUs (cuda:0 on)")
    accelerator = get_accelerator().device_name()
    if engine and accelerator != kind.type:
        raise ConfigError(
            f"--device {device}: DeepSpeed's engine would run on its accelerator, {accelerator}; "
            f"set DS_ACCELERATOR={kind.type} to time it there"
        )


def check(bench: Bench) -> None:
    """Fails before anything is timed on what would fail later: an unknown scheme, a vocabulary of
    special symbols only, an unknown peer or device, a torchscale comparison torchscale cannot run."""
    build_scheme(bench.model)
    check_device(bench.device, engine="deepspeed" in bench.peers)
    if bench.model.tgt_vocab_size <= NUM_SPECIAL:
        raise ConfigError(f"--vocab: {bench.model.tgt_vocab_size} leaves no words beside {NUM_SPECIAL} special symbols")
    unknown = set(bench.peers) - set(PEERS)
    if unknown:
        raise ConfigError(f"--compare: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PEERS)}")
    if "compiled" in bench.peers and (missing := compiler_missing()):
        raise ConfigError(f"--compare compiled: torch.compile cannot build kernels here: {missing}")
    if "torchscale" in bench.peers:
        if bench.model.norm_scheme not in TORCHSCALE_SCHEMES:
            raise ConfigError(
                f"--scheme: torchscale has no {bench.model.norm_scheme}; compare {', '.join(TORCHSCALE_SCHEMES)} "
                "with torchscale"
            )
        try:
            import_torchscale()
        except ImportError as err:
            raise ConfigError(f"--compare torchscale: torchscale is not importable ({err}); run `make peers`") from None


def step_times(system: str, cfg: ModelConfig, batch: MicroBatch, bench: Bench) -> list[float]:
    """Seconds of each timed training step of `system`, freshly built."""
    with BUILDERS[system](cfg, batch, bench.precision, bench.device) as step:
        return time_steps(step, bench.warmup, bench.steps)


def run(bench: Bench) -> list[Result]:
    """Every system at every depth. The systems of one depth take turns for `rounds` rounds, so a
    slow spell of a shared machine falls on all of them; each one's time is the median over rounds."""
    batch = synthetic_batch(bench.model.src_vocab_size, bench.batch, bench.src_len, bench.tgt_len)
    results = []
    for depth in bench.depths:
        cfg = replace(bench.model, encoder_layers=depth, decoder_layers=depth)
        flops = model_flops(cfg, bench.src_len, bench.tgt_len, bench.batch)
        times: dict[str, list[float]] = {system: [] for system in bench.systems}
        for _ in range(bench.rounds):
            for system in bench.systems:
                times[system] += step_times(system, cfg, batch, bench)
                gc.collect()  # the last model and optimizer (DeepSpeed's engine is full of cycles) before the next
        for system in bench.systems:
            seconds = statistics.median(times[system])
            results.append(
                Result(
                    system=system,
                    depth=depth,
                    step_s=seconds,
                    tokens_per_s=bench.batch * bench.tgt_len / seconds,
                    flops_per_s=flops / seconds,
                    per_layer_s=seconds / (2 * depth),
                )
            )
    compare(results)
    return results


def with_peak(results: list[Result], peak: float) -> None:
    for r in results:
        r.peak_fraction = r.flops_per_s / peak


def compare(results: list[Result]) -> None:
    """Fills each result's ratios to our plain loop at its depth and to its system's shallowest depth."""
    ours = {r.depth: r for r in results if r.system == "fathom"}
    shallowest = {}
    for r in sorted(results, key=lambda r: r.depth):
        shallowest.setdefault(r.system, r)
        r.per_layer_vs_shallowest = r.per_layer_s / shallowest[r.system].per_layer_s
        if r.system == "torchscale":
            r.fathom_speedup = ours[r.depth].tokens_per_s / r.tokens_per_s
        elif r.system == "deepspeed":
            r.engine_overhead = r.step_s / ours[r.depth].step_s - 1
        elif r.system == "compiled":
            r.compile_speedup = ours[r.depth].step_s / r.step_s
        elif r.system == "bf16-weights":
            r.bf16_speedup = r.tokens_per_s / ours[r.depth].tokens_per_s


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
    steps = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    seconds = [r["tokens"] / r["tokens_per_s"] for r in steps if "tokens_per_s" in r]
    steady = seconds[2:] or seconds
    model = json.loads((run_dir / "config.json").read_text())["model"] if (run_dir / "config.json").exists() else None
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
