"""Outer state: Nesterov outer step, hashing, and checkpoint bytes."""

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ttpeer.train import (
    CheckpointError,
    OuterState,
    outer_step,
    state_from_bytes,
    state_hash,
    state_to_bytes,
)

torch.set_num_threads(1)

SHAPES = {"fc.weight": (7, 5), "fc.bias": (7,), "norm.running_mean": (7,)}


def _state(seed: int = 0) -> OuterState:
    gen = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    momentum = {n: torch.randn(s, generator=gen) * 0.1 for n, s in SHAPES.items()}
    return OuterState(params=params, momentum=momentum)


def _deltas(seed: int, count: int) -> list[tuple[dict[str, torch.Tensor], int]]:
    gen = torch.Generator().manual_seed(seed)
    return [({n: torch.randn(s, generator=gen) * 0.01 for n, s in SHAPES.items()}, 100 * (i + 1))
            for i in range(count)]


@pytest.mark.slow
def test_outer_step_matches_torch_sgd_nesterov():
    state = OuterState(params=_state(1).params,
                       momentum={n: torch.zeros(s) for n, s in SHAPES.items()})
    reference = {n: torch.nn.Parameter(t.clone()) for n, t in state.params.items()}
    sgd = torch.optim.SGD(reference.values(), lr=0.7, momentum=0.9, nesterov=True)
    for round_ in range(3):
        deltas = _deltas(10 + round_, 3)
        total = sum(samples for _, samples in deltas)
        for name, param in reference.items():
            param.grad = sum(d[name].double() * (s / total) for d, s in deltas).float()
        sgd.step()
        state = outer_step(state, deltas, lr=0.7, momentum=0.9, nesterov=True)
        for name, param in reference.items():
            assert torch.allclose(state.params[name], param.detach(), rtol=1e-6, atol=1e-7)
            buf = sgd.state[param]["momentum_buffer"]
            assert torch.allclose(state.momentum[name], buf, rtol=1e-6, atol=1e-7)


def test_outer_step_is_bit_deterministic_and_pure():
    state, deltas = _state(2), _deltas(3, 4)
    before = state_hash(state)
    first, second = outer_step(state, deltas), outer_step(state, deltas)
    assert state_hash(first) == state_hash(second) != before
    assert state_hash(state) == before  # the input was not changed


def test_outer_step_without_nesterov_uses_the_buffer():
    state = OuterState(params=_state(4).params,
                       momentum={n: torch.zeros(s) for n, s in SHAPES.items()})
    delta = {n: torch.ones(s) for n, s in SHAPES.items()}
    result = outer_step(state, [(delta, 1)], lr=0.5, momentum=0.9, nesterov=False)
    assert torch.allclose(result.params["fc.bias"], state.params["fc.bias"] - 0.5)


@pytest.mark.parametrize("deltas", [[], [({n: torch.zeros(s) for n, s in SHAPES.items()}, 0)],
                                    [({"fc.bias": torch.zeros(7)}, 1)]])
def test_outer_step_rejects_bad_input(deltas):
    with pytest.raises(ValueError):
        outer_step(_state(), deltas)


def test_state_hash_covers_params_momentum_and_names():
    state = _state(5)
    assert state_hash(state).startswith("sha256:") and len(state_hash(state)) == 71
    assert state_hash(state) == state_hash(_state(5))
    tweaked = _state(5)
    tweaked.momentum["fc.bias"][0] += 1e-7
    assert state_hash(tweaked) != state_hash(state)
    renamed = OuterState(params={"x" + k: v for k, v in state.params.items()},
                         momentum={"x" + k: v for k, v in state.momentum.items()})
    assert state_hash(renamed) != state_hash(state)


def test_state_bytes_round_trip():
    state = _state(6)
    data = state_to_bytes(state)
    back = state_from_bytes(data, like=state)
    assert list(back.params) == list(state.params)
    assert state_hash(back) == state_hash(state)
    assert state_hash(state_from_bytes(bytearray(data))) == state_hash(state)


def _tamper_dtype(data: bytes) -> bytes:
    name = sorted(SHAPES)[0].encode()
    at = data.index(name) + len(name)
    return data[:at] + bytes([2]) + data[at + 1:]


@pytest.mark.parametrize("tamper,message", [
    (lambda d: b"XXXX" + d[4:], "bad magic"),
    (lambda d: d[:4] + struct.pack("<I", 2) + d[8:], "version 2"),
    (lambda d: d[:8] + struct.pack("<I", 10**9) + d[12:], "cap"),
    (lambda d: d[:-1], "body"),
    (lambda d: d + b"\0", "body"),
    (lambda d: d[:20], "truncated"),
    (_tamper_dtype, "only float32"),
])
def test_tampered_state_bytes_raise_checkpoint_error(tamper, message):
    with pytest.raises(CheckpointError, match=message):
        state_from_bytes(tamper(state_to_bytes(_state(7))))


def test_state_bytes_must_match_like():
    data = state_to_bytes(_state(8))
    other = OuterState(params={"fc.weight": torch.zeros(5, 7), "fc.bias": torch.zeros(7),
                               "norm.running_mean": torch.zeros(7)},
                       momentum={"fc.weight": torch.zeros(5, 7), "fc.bias": torch.zeros(7),
                                 "norm.running_mean": torch.zeros(7)})
    with pytest.raises(CheckpointError, match="shape"):
        state_from_bytes(data, like=other)
    fewer = OuterState(params={"fc.bias": torch.zeros(7)}, momentum={"fc.bias": torch.zeros(7)})
    with pytest.raises(CheckpointError, match="does not match"):
        state_from_bytes(data, like=fewer)


@settings(max_examples=200, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 255)), max_size=6),
       cut=st.integers(0, 2000))
def test_mutated_state_bytes_only_raise_checkpoint_error(flips, cut):
    buf = bytearray(state_to_bytes(_state(9)))
    for position, xor in flips:
        buf[position % len(buf)] ^= xor
    try:
        state_from_bytes(bytes(buf[:cut]) if cut < len(buf) else bytes(buf))
    except CheckpointError:
        pass


def test_scalar_empty_and_transposed_tensors_round_trip():
    params = {"scale": torch.tensor(1.5), "empty": torch.zeros(0, 3),
              "t": torch.arange(6.0).reshape(2, 3).t()}
    state = OuterState(params=params, momentum={k: torch.zeros_like(v) for k, v in params.items()})
    back = state_from_bytes(state_to_bytes(state), like=state)
    assert state_hash(back) == state_hash(state)
    assert all(torch.equal(back.params[n], params[n]) for n in params)
