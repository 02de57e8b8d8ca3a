"""The outer step: average the peers' pseudo-gradients and apply Nesterov SGD.

Every peer runs this on the same inputs and must get bit-identical results, so
the arithmetic is pinned down: fp32 on the CPU, deltas accumulated in the order
given, and every update written as separate multiplies and adds. (torch's fused
``add(..., alpha=)`` may use FMA in vector lanes and not in the tail, which
rounds differently on different CPUs.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._state import OuterState


def outer_step(state: OuterState, deltas: list[tuple[dict[str, Tensor], int]], *,
               lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True) -> OuterState:
    """Return a new state after one outer SGD step; the inputs are not changed.

    The gradient is the sample-weighted mean of ``deltas`` (pairs of delta and
    sample count, weights ``samples / total``), summed in list order. Then, as
    ``torch.optim.SGD`` does: ``buf = momentum*buf + g``; ``step = g +
    momentum*buf`` (Nesterov) or ``buf``; ``p = p - lr*step``.

    Raises ValueError if ``deltas`` is empty, a sample count is negative or all
    are zero, or a delta's names or shapes differ from the state's.
    """
    if not deltas:
        raise ValueError("outer_step needs at least one delta")
    total = sum(samples for _, samples in deltas)
    if any(samples < 0 for _, samples in deltas) or total <= 0:
        raise ValueError(f"sample counts must be >= 0 with a positive total, got "
                         f"{[samples for _, samples in deltas]}")
    for delta, _ in deltas:
        if delta.keys() != state.params.keys() or any(
                delta[n].shape != p.shape for n, p in state.params.items()):
            raise ValueError("every delta must have the state's names and shapes")

    # Weights are rounded to fp32 once, here, so no device or kernel picks its own precision.
    weights = [_f32(samples / total) for _, samples in deltas]
    lr_t, mu_t = _f32(lr), _f32(momentum)
    params: dict[str, Tensor] = {}
    buffers: dict[str, Tensor] = {}
    for name, param in state.params.items():
        grad = torch.zeros_like(param)
        for (delta, _), weight in zip(deltas, weights, strict=True):
            grad = grad + delta[name].to("cpu", torch.float32) * weight
        buf = state.momentum[name] * mu_t + grad
        step = grad + buf * mu_t if nesterov else buf
        params[name] = param - step * lr_t
        buffers[name] = buf
    return OuterState(params=params, momentum=buffers)


def _f32(value: float) -> Tensor:
    return torch.tensor(value, dtype=torch.float32)
