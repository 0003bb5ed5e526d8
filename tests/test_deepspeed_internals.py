"""The DeepSpeed internals fathom uses (pipeline/engine/internals.py) exist in the installed DeepSpeed
and do what fathom relies on, on a real one-stage ZeRO-1 engine; another DeepSpeed version is refused in
one line; setup.cfg pins the supported one."""

import contextlib
import functools
import io
import itertools
import math
import subprocess
import sys
import types

import pytest
import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.engine import DeepSpeedEngine

from fathom.model.model_config import ModelConfig
from fathom.pipeline.config.run_config import DataConfig, RunConfig, TrainConfig
from fathom.pipeline.engine.internals import (
    SUPPORTED_VERSION,
    built_stage_bounds,
    check_for_duplicates,
    check_version,
    checkpoint_engine,
    clear_pipe_buffers,
    loss_scale,
    replace_model_step,
    set_self_reduction,
    stage_layers,
    stage_range,
    tensor_backwards_joined,
    typed_receive_buffers,
    universal_loading,
    wrap_instructions,
    zero_gradient_slice,
    zero_sharded,
)
from fathom.pipeline.parts.specs import layer_specs
from fathom.pipeline.train import build_engine
from fathom.tools.timed_steps import synthetic_batch
from tests.helpers import ROOT


def test_another_deepspeed_version_is_one_line(capsys):
    for installed in ("0.20.0", "0.19.7"):
        with pytest.raises(SystemExit) as exc:
            check_version(installed)
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and len(err.splitlines()) == 1, err
        assert f"DeepSpeed {installed} is installed" in err and f"pip install deepspeed=={SUPPORTED_VERSION}" in err
    check_version(SUPPORTED_VERSION)
    check_version(f"{SUPPORTED_VERSION}+cpu")


def test_setup_pins_the_supported_version():
    assert f"deepspeed=={SUPPORTED_VERSION}" in (ROOT / "setup.cfg").read_text()


def test_the_linear_duplicate_check_agrees_with_deepspeeds():
    """Same verdict and message as DeepSpeed's own check, for parameters once in one group, in two
    groups, and twice in one group."""
    module = torch.nn.Linear(2, 2)
    engine = types.SimpleNamespace(module=module)
    weight, bias = module.weight, module.bias
    for groups in ([[weight, bias]], [[weight], [bias]], [[weight], [bias, weight]], [[weight, bias, bias]]):
        optimizer = types.SimpleNamespace(param_groups=[{"params": group} for group in groups])
        verdicts = []
        for check in (DeepSpeedEngine._check_for_duplicates, check_for_duplicates):
            try:
                check(engine, optimizer)
                verdicts.append(None)
            except AssertionError as error:
                verdicts.append(str(error))
        assert verdicts[0] == verdicts[1], groups
    assert verdicts[0] and "Parameter with name: bias occurs multiple times" in verdicts[0]


def fused_and_deepspeeds_scans(optimizer) -> list[tuple[bool, bool, float, float]]:
    """ZeRO's scans of the gradient partition as it is, then with one element of its last tensor set to
    NaN, +inf and -inf: (overflow verdict fused, DeepSpeed's; gradient norm fused, DeepSpeed's) each
    time; the element restored."""
    grads, params = optimizer.averaged_gradients[0], optimizer.params_in_partition[0]
    grad = grads[-1]
    first = (0,) * grad.dim()
    kept = grad[first].item()
    scans = []
    for value in (kept, math.nan, math.inf, -math.inf):
        grad[first] = value
        fused = optimizer.has_overflow_partitioned_grads_serial()
        deepspeeds = type(optimizer).has_overflow_partitioned_grads_serial(optimizer)
        norm = optimizer.get_grad_norm_direct(grads, params)
        deepspeeds_norm = type(optimizer).get_grad_norm_direct(optimizer, grads, params)
        scans.append((bool(fused), bool(deepspeeds), norm.item(), deepspeeds_norm.item()))
    grad[first] = kept
    return scans


def passes_over_gradients(optimizer, monkeypatch) -> int:
    """How many multi-tensor norms the fused check and norm of one step run."""
    calls = []
    foreach_norm = torch._foreach_norm
    monkeypatch.setattr(
        torch, "_foreach_norm", lambda *args, **kwargs: calls.append(1) or foreach_norm(*args, **kwargs)
    )
    optimizer.has_overflow_partitioned_grads_serial()
    optimizer.get_grad_norm_direct(optimizer.averaged_gradients[0], optimizer.params_in_partition[0])
    monkeypatch.undo()
    return len(calls)


SMALL_MODEL = functools.partial(ModelConfig, encoder_layers=2, decoder_layers=2, embed_dim=16, ffn_dim=32,
                                attention_heads=2, src_vocab_size=20, tgt_vocab_size=20)  # fmt: skip
# one stage, ZeRO-1, fp32, a step of one micro-batch of 2 pairs
ONE_STAGE = {
    "train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
    "steps_per_print": 10**9, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 1}, "pipeline": {"stages": 1, "activation_checkpoint_interval": 0},
}  # fmt: skip


@pytest.mark.slow
def test_each_internal_does_what_fathom_relies_on(process_group, monkeypatch):
    cfg, ds = SMALL_MODEL(norm_scheme="pre_ln"), ONE_STAGE
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's layer list
        engine = build_engine(RunConfig(model=cfg, data=DataConfig(), train=TrainConfig(), deepspeed=ds))
    layers = len(layer_specs(cfg))
    assert engine.module.parts == [0, layers]  # ExternallyPartitioned: fathom's cut, not DeepSpeed's
    assert stage_range(engine.module) == range(layers)
    assert [index for _, index, _ in stage_layers(engine.module)] == list(range(layers))
    assert built_stage_bounds(engine.module) == [0, layers] and all(
        type(b) is int for b in built_stage_bounds(engine.module)
    )
    with universal_loading(engine):  # what a resume on another shape loads with (pipeline/checkpoint/reshape.py)
        assert engine.load_universal_checkpoint()
    assert not engine.load_universal_checkpoint()
    assert type(checkpoint_engine(engine)).__name__ == "CommittingCheckpointEngine"
    assert isinstance(checkpoint_engine(engine), TorchCheckpointEngine)

    params = [p for p in engine.module.parameters() if p.requires_grad]
    slices, scans, passes = [], [], []

    def step(*args, **kwargs):  # between backward and the update, where fathom's guard runs
        slices.append([zero_gradient_slice(p) for p in params])
        scans.extend(fused_and_deepspeeds_scans(engine.optimizer))
        passes.append(passes_over_gradients(engine.optimizer, monkeypatch))
        original(*args, **kwargs)

    original = replace_model_step(engine, step)
    ran = []

    def timed(name, method):
        def run(engine, **kwargs):
            ran.append(name)
            method(engine, **kwargs)

        return run

    names = wrap_instructions(engine, timed)
    optimizer, reductions = engine.optimizer, []
    allreduce_bucket = optimizer.allreduce_bucket  # not monkeypatch: passes_over_gradients undoes that
    optimizer.allreduce_bucket = lambda *args, **kwargs: reductions.append(1) or allreduce_bucket(*args, **kwargs)
    batch = synthetic_batch(20, batch=2, src_len=5, tgt_len=5)
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.train_batch(data_iter=itertools.repeat(batch))
    assert len(slices) == 1 and any(
        not torch.equal(a, p) for a, p in zip(before, engine.module.parameters(), strict=True)
    )
    assert {"ForwardPass", "BackwardPass", "SendActivation", "RecvGrad", "OptimizerStep"} <= set(names)
    # one stage: load, forward, backward, the reductions and the step, each through `timed`
    assert ran == ["LoadMicroBatch", "ForwardPass", "BackwardPass", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]
    assert loss_scale(engine) == 1.0  # fp32
    assert all(zero_sharded(p) for p in params)
    assert sum(s.numel() for s in slices[0]) == sum(p.numel() for p in params)  # one rank holds every slice
    assert all(torch.isfinite(s).all() for s in slices[0]) and any(s.abs().sum() > 0 for s in slices[0])
    # the fused scans (set_gradient_scans, which build_engine installs) agree with DeepSpeed's, bit for bit
    assert [scan[:2] for scan in scans] == [(False, False), (True, True), (True, True), (True, True)]
    assert scans[0][2] == scans[0][3] > 0 and all(scan[2] == scan[3] == -1 for scan in scans[1:])  # -1: not finite
    assert passes == [1]  # the norm reuses what the check measured
    assert reductions == []  # one replica: no all-reduce of the gradients with themselves (set_self_reduction)
    set_self_reduction(engine, skipped=False)
    engine.train_batch(data_iter=itertools.repeat(batch))
    assert reductions == [1]  # DeepSpeed's own, which the skip replaces
    clear_pipe_buffers(engine)
    assert engine.loss is None


@pytest.mark.slow
def test_reading_translating_and_converting_do_not_import_deepspeed():
    """DeepSpeed is the training engine only: the model, data preparation, checkpoint reading,
    translation and conversion (a save_dir's zero_to_fp32.py too) import without it (its logger writes to
    stdout, and a machine that only translates need not build it)."""
    modules = ["model", "model.parts", "model.fold", "model.trained", "corpus.prepare", "corpus.batches",
               "common.run_layout", "common.checkpoint_format", "pipeline.config", "pipeline.parts.stage_modules",
               "translation.translate", "translation.translator", "translation.generate", "convert.to_fairseq",
               "convert.from_fairseq", "convert.average", "pipeline.checkpoint.consolidated"]  # fmt: skip
    code = f"import importlib, sys; [importlib.import_module('fathom.' + m) for m in {modules!r}]; "
    code += "print('deepspeed' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_backward_calls_that_retain_the_graph_run_as_one():
    """DeepSpeed's per-output pattern (all but the last output with retain_graph) inside
    tensor_backwards_joined: the shared part of the graph runs backward once, and the gradients are
    those of the two calls."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, requires_grad=True)
    runs = []

    def outputs():
        shared = x * 2
        shared.register_hook(lambda grad: runs.append(1))
        encoder_out = shared.tanh()
        return encoder_out.sin() * 3, encoder_out  # the decoder state depends on encoder_out

    gradients = torch.randn(4, 3), torch.randn(4, 3)
    y, e = outputs()
    y.backward(gradients[0], retain_graph=True)
    e.backward(gradients[1])
    expected, x.grad = x.grad, None
    assert len(runs) == 2
    runs.clear()
    y, e = outputs()
    with tensor_backwards_joined():
        y.backward(gradients[0], retain_graph=True)
        assert x.grad is None and not runs  # held until the last output's call
        e.backward(gradients[1])
    assert len(runs) == 1
    torch.testing.assert_close(x.grad, expected)


def test_receive_buffers_keep_their_dtype():
    """A middle stage's receives, as DeepSpeed's engine asks typed_receive_buffers for them: token ids, then
    encoder_out's float gradient in the same position of its message, then shorter token ids. Each buffer
    has the dtype and shape asked for, and one of a position and dtype is reused while it is large enough."""
    engine = types.SimpleNamespace(device=torch.device("cpu"))
    typed_receive_buffers(engine)
    receive = engine._allocate_or_extend_buffers
    ids = receive(1, [3, 5], torch.long)
    gradient = receive(1, [3, 5, 16], torch.float32)
    shorter = receive(1, [3, 4], torch.long)
    assert (gradient.dtype, gradient.shape) == (torch.float32, (3, 5, 16))
    assert (shorter.dtype, shorter.shape) == (torch.long, (3, 4)) and shorter.data_ptr() == ids.data_ptr()
    assert receive(1, [3, 6], torch.long).shape == (3, 6) and receive(0, [], torch.float32).shape == ()


@pytest.mark.slow  # builds and trains DeepSpeed's engine
@pytest.mark.parametrize("poisoned", [False, True])
def test_the_guard_and_zeros_scans_read_each_gradient_once_a_step(process_group, monkeypatch, poisoned):
    """bf16 with clipping, as scripts/train.py runs it: fathom's stability guard, ZeRO's check for
    non-finite gradients and its gradient norm take their norms from one multi-tensor pass over the
    gradients (GradientNorms); a gradient the guard sees go non-finite is measured anew, so the step
    is still skipped."""
    from fathom.pipeline.safety.divergence import StabilityGuard
    from fathom.tools.in_process_engine import built_engine

    cfg = SMALL_MODEL(norm_scheme="deepnorm")
    ds = {**ONE_STAGE, "bf16": {"enabled": True}, "gradient_clipping": 1.0}
    with built_engine(cfg, ds, "cpu") as engine:
        guard = StabilityGuard(engine, cfg)
        if poisoned:  # the guard finds the loss non-finite: it fills the (finite) gradients with NaN
            summary = guard._local_summary
            guard._local_summary = lambda grads: summary(grads).index_fill_(0, torch.tensor([0]), 1.0)
        passes = []
        foreach_norm = torch._foreach_norm
        monkeypatch.setattr(
            torch,
            "_foreach_norm",
            lambda tensors, *args, **kwargs: passes.append(len(tensors)) or foreach_norm(tensors, *args, **kwargs),
        )
        engine.train_batch(data_iter=itertools.repeat(synthetic_batch(20, batch=2, src_len=5, tgt_len=5)))
        monkeypatch.undo()
        tensors = sum(1 for p in engine.module.parameters() if p.requires_grad)
        assert guard.skipped == poisoned
        assert passes == ([tensors, tensors] if poisoned else [tensors])
