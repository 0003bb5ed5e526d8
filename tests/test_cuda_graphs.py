"""train.cuda_graphs and what it rests on, where a CPU can check it: the replayed layers' gradients
accumulate over micro-batches as eager ones do, the config refuses what graphs cannot run, padding to a
multiple leaves the loss as it was, and BranchNorm's alpha_t read from a tensor follows the step. The
graphs themselves train against the eager layers in tests/test_gpu.py."""

import json

import pytest
import torch

from fathom.common.errors import ConfigError
from fathom.corpus.batches import collate
from fathom.model import ModelConfig, Transformer
from fathom.model.loss import label_smoothed_cross_entropy
from fathom.model.model_config import PAD
from fathom.model.norms import BranchScaled, PostNorm
from fathom.pipeline.config.run_data import resolve_run
from fathom.pipeline.engine import cuda_graphs
from fathom.pipeline.engine.cuda_graphs import GraphedLayer, Recording, check_cuda_graphs, graph_layers, replayed
from tests.helpers import ROOT, launch, trained_in_process
from tests.workers.recorded import PARAMETERS, eager_record

DEFAULT = ROOT / "ds_configs" / "default.json"


def eager_recording(weight: torch.nn.Parameter) -> Recording:
    """y = x W^T recorded as a graph would hold it: fixed buffers, and replays that write into them."""
    x = torch.zeros(2, 3, requires_grad=True)
    y, grad_y = torch.zeros(2, 4), torch.zeros(2, 4)
    grad_x, grad_w = torch.zeros(2, 3), torch.zeros(4, 3)

    def forward() -> None:
        y.copy_(x.detach() @ weight.detach().T)

    def backward() -> None:
        grad_x.copy_(grad_y @ weight.detach())
        grad_w.copy_(grad_y.T @ x.detach())

    return Recording((x,), (y,), (grad_y,), (grad_x,), (grad_w,), forward, backward)


def test_replayed_gradients_accumulate_over_micro_batches_as_eager_ones_do():
    """A replay overwrites the recording's gradient buffers: a parameter's .grad must never be one of
    them (torch's make_graphed_callables lets autograd adopt them, and accumulation then doubles the
    last micro-batch's gradient instead of adding the first's)."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 3))
    inputs = [torch.randn(2, 3, requires_grad=True) for _ in range(2)]
    layer = replayed(eager_recording(weight), [weight])
    for x in inputs:
        (y,) = layer(x)
        (y * y).sum().backward()
    replayed_grads = weight.grad.clone(), [x.grad.clone() for x in inputs]

    weight.grad = None
    for x in inputs:
        x.grad = None
        (x @ weight.T).pow(2).sum().backward()
    torch.testing.assert_close(replayed_grads[0], weight.grad)
    for ours, theirs in zip(replayed_grads[1], inputs, strict=True):
        torch.testing.assert_close(ours, theirs.grad)


@pytest.mark.slow  # builds and trains DeepSpeed's engine
def test_graphed_layers_train_what_the_eager_layers_train(process_group, monkeypatch):
    """Everything around the graphs on a real engine: inputs passed through (token ids, encoder_out),
    outputs copied out of the buffers in the forward pass, the recomputation under activation
    checkpointing, dropout's generator put back after recording, a recording per input shape (two
    here). With replays that run the layer eagerly into fixed buffers, as graphs write theirs, the
    engine trains the eager engine's losses, bit for bit, and its weights."""
    monkeypatch.setattr(cuda_graphs, "recordable", lambda t: True)
    monkeypatch.setattr(cuda_graphs, "record", eager_record)
    cfg = ModelConfig(
        encoder_layers=2, decoder_layers=2, embed_dim=16, ffn_dim=32, attention_heads=2, src_vocab_size=20,
        tgt_vocab_size=20, dropout=0.3, attention_dropout=0.2, norm_scheme="deepnorm",
    )  # fmt: skip
    ds = {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "steps_per_print": 10**9, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1}, "pipeline": {"stages": 1, "activation_checkpoint_interval": 1},
    }  # fmt: skip
    layers = []

    def graphed(engine) -> None:
        PARAMETERS.update({p.data_ptr(): p for p in engine.module.parameters()})
        graph_layers(engine.module)
        layers.extend(m.forward for m in engine.module.modules() if isinstance(m.forward, GraphedLayer))

    eager = trained_in_process(cfg, ds)
    ours = trained_in_process(cfg, ds, graphed)
    assert len(layers) == 4 and all(len(layer.graphs) == 2 for layer in layers)
    assert ours[0] == eager[0] and len(set(eager[0])) == 3
    # Bit for bit in the losses; the weights to float rounding: autograd sums a few gradients in another
    # order, and Adam turns the rounding noise of gradients that are zero in exact arithmetic (k_proj's
    # bias: softmax ignores a shift of all scores) into steps of up to the learning rate.
    for a, b in zip(ours[1], eager[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-4)


@pytest.mark.slow  # two launched 2-stage runs
def test_graphed_layers_train_across_stages_what_the_eager_layers_train(tmp_path):
    """At 2 stages the pipeline runs a micro-batch's forward before the previous one's backward, so a
    layer replays again while the stage still holds its last output: the output must have been copied
    out of the graph's buffers. The default job with dropout, replays that write fixed buffers as graphs
    do, and BranchNorm's alpha moving every step trains the eager run's losses and gradient norms."""
    overrides = [
        "pipeline.activation_checkpoint_interval=1", "model.encoder_layers=2", "model.decoder_layers=2",
        "model.embed_dim=32", "model.ffn_dim=64", "model.branchnorm.T=3", "data.synthetic.sentences=200",
        "data.pad_to_multiple=4", "train.max_steps=4", "train.save_interval=4", "train.log_interval=1",
    ]  # fmt: skip
    runs = []
    for graphs in ("false", "true"):
        save = tmp_path / graphs
        args = ["--config", str(DEFAULT), "--override", *overrides, f"train.cuda_graphs={graphs}"]
        script = ROOT / "tests" / "workers" / "graphs.py" if graphs == "true" else ROOT / "scripts" / "train.py"
        assert launch(script, *args, f"train.save_dir={save}").returncode == 0
        runs.append([json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()])
    eager, graphed = runs
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in graphed] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in eager
    ]


def test_replayed_forward_without_autograd_copies_inputs_in():
    weight = torch.nn.Parameter(torch.eye(4, 3))
    layer = replayed(eager_recording(weight), [weight])
    with torch.no_grad():
        (y,) = layer(torch.ones(2, 3))
    assert y.tolist() == [[1.0, 1.0, 1.0, 0.0]] * 2 and not y.requires_grad


@pytest.mark.parametrize(
    "overrides, gpu, message",
    [
        ([], False, "train.cuda_graphs: CUDA graphs need a CUDA GPU, and torch sees none here; set it false"),
        (["pipeline.activation_checkpoint_interval=1", "train.compile=true"], True, "set train.compile false"),
        ([], True, "needs activation checkpointing (a layer's graph holds one micro-batch's activations at a time)"),
    ],
)
def test_cuda_graphs_are_refused_where_they_cannot_run(monkeypatch, overrides, gpu, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    cfg, _ = resolve_run(DEFAULT, ["train.cuda_graphs=true", *overrides], world_size=2)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_cuda_graphs(cfg)


def test_pad_to_multiple_pads_each_side_and_leaves_the_loss_as_it_was():
    pairs = [(torch.tensor([5, 6, 7]), torch.tensor([8, 9])), (torch.tensor([5]), torch.tensor([6, 7, 8, 9, 10]))]
    (src, prev), target = collate(pairs)
    (src4, prev4), target4 = collate(pairs, pad_to_multiple=4)
    assert src.shape == (2, 4) and target.shape == prev.shape == (2, 6)
    assert src4.shape == (2, 4) and target4.shape == prev4.shape == (2, 8)
    assert target4[:, 6:].eq(PAD).all() and torch.equal(target4[:, :6], target)

    cfg = ModelConfig(
        encoder_layers=2, decoder_layers=2, embed_dim=16, ffn_dim=32, attention_heads=2, dropout=0.0,
        src_vocab_size=12, tgt_vocab_size=12,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    losses = [label_smoothed_cross_entropy(model(s, p), t).item() for (s, p), t in (collate(pairs), collate(pairs, 4))]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_branchnorm_alpha_read_from_a_tensor_follows_the_step():
    torch.manual_seed(0)
    residual = BranchScaled(lambda step: min(1.0, step / 4))
    residual.hold_alpha_in_tensor()
    norm = torch.nn.LayerNorm(8)
    x = torch.randn(3, 8)
    for step in (0, 1, 3, 9):
        residual.set_step(step)
        expected = PostNorm(branch_scale=min(1.0, step / 4))(x, torch.tanh, norm)
        torch.testing.assert_close(residual(x, torch.tanh, norm), expected, rtol=0, atol=1e-6)
    assert "alpha" not in residual.state_dict()  # derived from the step: never in a checkpoint
