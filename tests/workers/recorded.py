"""pipeline/engine/cuda_graphs.py's `record` on a CPU, for tests/test_cuda_graphs.py and tests/workers/graphs.py:
replays write the layer's results into fixed buffers, which the next replay overwrites, as a graph's do."""

import torch

from fathom.pipeline.engine.cuda_graphs import Recording

# data_ptr -> parameter: the layer's own parameters, which a replay differentiates to where the graphs
# write the gradients of the stand-ins they were recorded with
PARAMETERS: dict[int, torch.nn.Parameter] = {}


def eager_record(run, samples, params) -> Recording:
    """cuda_graphs.record's contract on a CPU: replays write the layer's results into fixed buffers,
    which the next replay overwrites, as a graph's do; the layer itself runs eagerly at each replay."""
    assert all(p.data_ptr() in PARAMETERS and PARAMETERS[p.data_ptr()] is not p for p in params)  # stand-ins
    wrt = [t for t in samples if t.requires_grad] + [PARAMETERS[p.data_ptr()] for p in params]
    outputs = tuple(torch.empty_like(o) for o in run(*samples))
    grad_outputs = tuple(torch.empty_like(o) for o in outputs)
    input_grads = tuple(torch.empty_like(t) if t.requires_grad else None for t in samples)
    param_grads = tuple(torch.empty_like(p) for p in params)
    live = []

    def forward() -> None:
        with torch.enable_grad():
            live[:] = run(*samples)
        for buffer, value in zip(outputs, live, strict=True):
            buffer.copy_(value.detach())

    def backward() -> None:
        grads = torch.autograd.grad(live, wrt, grad_outputs, allow_unused=True)
        for buffer, grad in zip([g for g in input_grads if g is not None] + list(param_grads), grads, strict=True):
            buffer.copy_(grad) if grad is not None else buffer.zero_()

    return Recording(samples, outputs, grad_outputs, input_grads, param_grads, forward, backward)
