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
import gc
import itertools
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from fathom.common.errors import ConfigError
from fathom.corpus.batches import MicroBatch
from fathom.model.layers import compile_layers, compiler_missing
from fathom.model.model_config import NUM_SPECIAL, ModelConfig
from fathom.model.norms import build_scheme
from fathom.model.transformer import Transformer
from fathom.tools.in_process_engine import built_engine, check_device
from fathom.tools.timed_steps import (
    Step,
    deepspeed_config,
    plain_loop,
    synchronized,
    synthetic_batch,
    time_steps,
    weights_dtype,
)
from fathom.tools.torchscale_peer import TORCHSCALE_SCHEMES, import_torchscale, torchscale_model

PRECISIONS = ("fp32", "bf16", "autocast")  # what the benchmark trains in
# What our plain loop ("fathom") can be compared with; bf16-weights: ours in pure bf16 whatever the precision.
PEERS = ("torchscale", "deepspeed", "compiled", "bf16-weights")


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
