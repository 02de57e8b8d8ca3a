"""The outer step: average the peers' pseudo-gradients and apply Nesterov SGD.

Every peer runs this on the same inputs and must get bit-identical results, so
the arithmetic is pinned down: fp32 on the CPU, deltas accumulated in the order
given, and every update written as separate multiplies and adds. (torch's fused
``add(..., alpha=)`` may use FMA in vector lanes and not in the tail, which
rounds differently on different CPUs.)

The mean is a running sum (``OuterSum``): a round's contributions are decoded and
added one at a time, so memory holds one delta and the sum, however many
contributions the round has. Every element still sees ``((0 + d0*w0) + d1*w1) + ...``
in list order, the same operations as summing all deltas at once, so the result is
the same bits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from ._state import OuterState


class OuterSum:
    """The sample-weighted mean of a round's deltas, built one delta at a time.

    ``samples`` are the contributions' sample counts, in the order their deltas will
    be added (known before any delta is decoded: they come with the records).
    Raises ValueError if ``samples`` is empty, a count is negative or all are zero.
    """

    def __init__(self, state: OuterState, samples: Sequence[int]) -> None:
        if not samples:
            raise ValueError("outer_step needs at least one delta")
        total = sum(samples)
        if any(s < 0 for s in samples) or total <= 0:
            raise ValueError(f"sample counts must be >= 0 with a positive total, got {list(samples)}")
        self.state = state
        self._weights = mean_weights(samples)
        self._added = 0
        self.mean_sq = 0.0  # the mean's energy (sum of squares), once ``step`` has run with ``measure``
        # ``state`` may be a template (meta tensors, ``train.template``) when ``step`` is
        # given the base tensor by tensor: the sum is fp32 on the CPU either way.
        self._grad: dict[str, Tensor] = {name: torch.zeros(p.shape, dtype=torch.float32)
                                         for name, p in state.params.items()}

    def add(self, delta: dict[str, Tensor]) -> None:
        """Add the next delta (in ``samples`` order). Raises ValueError if its names or
        shapes differ from the state's, or every delta was already added."""
        if delta.keys() != self.state.params.keys() or any(
                delta[n].shape != p.shape for n, p in self.state.params.items()):
            raise ValueError("every delta must have the state's names and shapes")
        self.add_parts(delta.items())

    def add_parts(self, parts: Iterable[tuple[str, Tensor]]) -> None:
        """Add the next delta given tensor by tensor (``train.iter_delta``), each name
        once, in any order. Raises ValueError for a name or shape not the state's, a
        name twice or missing, or every delta already added; after such an error (or
        one raised by ``parts``) the sum is part-added: throw it away."""
        if self._added == len(self._weights):
            raise ValueError(f"all {len(self._weights)} deltas were already added")
        weight = self._weights[self._added]
        self._added += 1
        seen: set[str] = set()
        for name, tensor in parts:
            grad = self._grad.get(name)
            if grad is None or name in seen or tensor.shape != grad.shape:
                raise ValueError("every delta must have the state's names and shapes")
            seen.add(name)
            grad.add_(tensor.to("cpu", torch.float32) * weight)
        if len(seen) != len(self._grad):
            raise ValueError("every delta must have the state's names and shapes")

    def step(self, *, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True,
             base: Iterable[tuple[str, Tensor, Tensor]] | None = None, params_only: bool = False,
             measure: bool = False) -> OuterState:
        """The new state after the outer SGD step, as ``torch.optim.SGD`` takes it:
        ``buf = momentum*buf + g``; ``step = g + momentum*buf`` (Nesterov) or ``buf``;
        ``p = p - lr*step``. The state passed in is not changed; the sum is used up
        (each gradient tensor is dropped once its parameter is done, so the new state
        and the sum are never both whole). ``base``: the state's ``(name, param,
        momentum)`` one at a time (``train.iter_state_file``), for a state passed in as
        a template: the base is then never whole in memory either. ``params_only``: the
        new momentum is not kept (the result's ``momentum`` is its ``params``), for a
        caller that only wants where the step lands. ``measure``: also sum the mean's energy
        into ``mean_sq`` (``energy``; one more read of each tensor). Raises ValueError if
        a delta is missing, or ``base`` lacks a name or has one twice or a wrong shape."""
        if self._added != len(self._weights):
            raise ValueError(f"{self._added} of {len(self._weights)} deltas were added")
        lr_t, mu_t = _f32(lr), _f32(momentum)
        params: dict[str, Tensor] = {}
        buffers: dict[str, Tensor] = {}
        if base is None:
            base = ((n, p, self.state.momentum[n]) for n, p in self.state.params.items())
        for name, param, mom in base:
            grad = self._grad.pop(name, None)
            if grad is None or param.shape != grad.shape or mom.shape != grad.shape:
                raise ValueError("the base must have the state's names and shapes, each once")
            if measure:
                self.mean_sq += energy({name: grad})
            buf = mom * mu_t + grad
            step = grad + buf * mu_t if nesterov else buf
            params[name] = param - step * lr_t
            buffers[name] = params[name] if params_only else buf
        if self._grad:
            raise ValueError("the base must have the state's names and shapes, each once")
        return OuterState(params=params, momentum=buffers)


def outer_step(state: OuterState, deltas: list[tuple[dict[str, Tensor], int]], *,
               lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True) -> OuterState:
    """Return a new state after one outer SGD step; the inputs are not changed.

    The gradient is the sample-weighted mean of ``deltas`` (pairs of delta and
    sample count, weights ``samples / total``), summed in list order (see
    ``OuterSum``, which this is, for deltas already in memory).

    Raises ValueError if ``deltas`` is empty, a sample count is negative or all
    are zero, or a delta's names or shapes differ from the state's.
    """
    total = OuterSum(state, [samples for _, samples in deltas])
    for delta, _ in deltas:
        total.add(delta)
    return total.step(lr=lr, momentum=momentum, nesterov=nesterov)


def energy(tensors: dict[str, Tensor]) -> float:
    """The sum of squares of every value of ``tensors``, in fp32 (no copy of an fp32
    tensor): a figure for the records, not part of any state."""
    return sum(float(torch.linalg.vector_norm(t.detach(), dtype=torch.float32)) ** 2 for t in tensors.values())


def mean_weights(samples: Sequence[int]) -> list[Tensor]:
    """Each contribution's weight in the round's mean, ``samples / total``, rounded to fp32
    once, here, so no device or kernel picks its own precision (``OuterSum`` and a slice's
    reduction use the same). The caller checks the counts (``OuterSum`` does)."""
    total = sum(samples)
    return [_f32(s / total) for s in samples]


def _f32(value: float) -> Tensor:
    return torch.tensor(value, dtype=torch.float32)
