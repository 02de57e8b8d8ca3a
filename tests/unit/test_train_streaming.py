"""Bounded host memory: the outer step as a running sum, deltas decoded one tensor at a
time, states straight between files and tensors, encoding in chunks. Each must give
the same bits as the all-at-once code it replaced (peers of both versions share a pool)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from ttpeer import train
from ttpeer.train._outer import _f32

SHAPES = {"a": (1000, 1100), "b": (7,), "c": (333, 3), "d": (129, 2050)}  # > 1 << 20 values, odd sizes


def _old_outer_step(state: train.OuterState, deltas: list[tuple[dict[str, Tensor], int]], *,
                    lr: float, momentum: float, nesterov: bool) -> train.OuterState:
    """``outer_step`` as it was before the running sum (commit 73f6524), verbatim but for
    the argument checks: every delta of the round in memory at once."""
    total = sum(samples for _, samples in deltas)
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
    return train.OuterState(params=params, momentum=buffers)


def _random(g: torch.Generator, scale: float, shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict[str, Tensor]:
    return {n: torch.randn(s, generator=g) * scale for n, s in shapes.items()}


def _bits(state: train.OuterState) -> list[bytes]:
    return [t.numpy().tobytes() for t in [*state.params.values(), *state.momentum.values()]]


SMALL = {"a": (100, 110), "b": (7,), "c": (333, 3), "d": (129, 205)}


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_streamed_outer_step_is_bit_identical_to_the_old_one(nesterov: bool) -> None:
    g = torch.Generator().manual_seed(1)
    state = train.OuterState(params=_random(g, 1.0, SMALL), momentum=_random(g, 0.1, SMALL))
    deltas = [(_random(g, 0.01, SMALL), samples) for samples in (64, 0, 17, 64, 3, 128, 1)]
    deltas[2][0]["b"][:] = -0.0  # signed zeros: 0 + -0 is +0, the sum must start as the old one did
    old = _old_outer_step(state, deltas, lr=0.7, momentum=0.9, nesterov=nesterov)
    # As a list in memory, and as the executor does it: from encoded bytes, tensor by tensor.
    assert _bits(train.outer_step(state, deltas, lr=0.7, momentum=0.9, nesterov=nesterov)) == _bits(old)
    encoded = [(train.encode_delta(d, None)[0], s) for d, s in deltas]
    decoded = [(train.decode_delta(data, state), s) for data, s in encoded]
    total = train.OuterSum(state, [s for _d, s in encoded])
    for data, _s in encoded:
        total.add_parts(train.iter_delta(data, train.template(state)))
    streamed = total.step(lr=0.7, momentum=0.9, nesterov=nesterov)
    assert _bits(streamed) == _bits(_old_outer_step(state, decoded, lr=0.7, momentum=0.9, nesterov=nesterov))
    assert train.state_hash(streamed) == train.state_hash(train.outer_step(state, decoded, nesterov=nesterov))


def test_the_running_sum_refuses_a_wrong_or_missing_delta() -> None:
    g = torch.Generator().manual_seed(2)
    state = train.OuterState(params=_random(g, 1.0, SMALL), momentum=_random(g, 0.1, SMALL))
    total = train.OuterSum(state, [1, 1])
    with pytest.raises(ValueError, match="names and shapes"):
        total.add_parts(iter([("a", torch.zeros(3))]))
    total = train.OuterSum(state, [1])
    with pytest.raises(ValueError, match="0 of 1 deltas"):
        total.step()
    total.add(_random(g, 0.01, SMALL))
    with pytest.raises(ValueError, match="already added"):
        total.add(_random(g, 0.01, SMALL))


def test_the_step_measures_the_energy_of_the_mean_it_applied() -> None:
    g = torch.Generator().manual_seed(3)
    state = train.OuterState(params=_random(g, 1.0, SMALL), momentum=_random(g, 0.1, SMALL))
    deltas = [(_random(g, 0.01, SMALL), samples) for samples in (64, 17, 128)]
    total = train.OuterSum(state, [s for _d, s in deltas])
    for delta, _s in deltas:
        total.add(delta)
    total.step(lr=0.7, momentum=0.5)
    assert total.mean_sq == 0.0  # not asked for: not measured
    total = train.OuterSum(state, [s for _d, s in deltas])
    for delta, _s in deltas:
        total.add(delta)
    total.step(lr=0.7, momentum=0.5, measure=True)
    mean = {n: sum(d[n].double() * s for d, s in deltas) / 209 for n in SMALL}
    assert total.mean_sq == pytest.approx(sum(float((t ** 2).sum()) for t in mean.values()), rel=1e-5)
    assert train.energy(deltas[0][0]) == pytest.approx(sum(float((t.double() ** 2).sum())
                                                           for t in deltas[0][0].values()), rel=1e-5)
    # Peers that disagree: the mean keeps less than the deltas' weighted energy.
    spread = sum(train.energy(d) * s for d, s in deltas) / 209
    assert total.mean_sq < spread


# Bytes, new residual and decoded tensors of one seeded delta, as commit 73f6524's
# all-at-once encoder and decoder gave them (sha256 prefixes; computed with that commit).
GOLDEN = {8: ("4ec7973577f4748c31623d9cb756604d", "7de1b9d21640f4480fc12aa574a86529",
              "dd49398dc5e5eedc4fb86431d79f8c43"),
          4: ("30ea2223121b5353dbd933bf54b24022", "6c7d9a35cea586c11ccfc87c4e023639",
              "2c49a0af2fd48b1b5f7a6822fe7b9fe1")}


@pytest.mark.parametrize("bits", [8, 4])
def test_chunked_encoding_and_per_tensor_decoding_give_the_old_bytes(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    delta = _random(g, 0.01)
    delta["b"][:] = 0.0  # an all-zero block
    residual = _random(g, 0.001)
    data, new_residual = train.encode_delta(delta, residual, bits=bits)
    like = train.template(train.OuterState(params=delta, momentum=delta))  # meta: names and shapes only
    decoded = train.decode_delta(data, like)

    def digest(tensors: dict[str, Tensor]) -> str:
        return hashlib.sha256(b"".join(tensors[n].contiguous().numpy().tobytes() for n in sorted(tensors))).hexdigest()

    assert (hashlib.sha256(data).hexdigest()[:32], digest(new_residual)[:32], digest(decoded)[:32]) == GOLDEN[bits]
    assert list(decoded) == list(SHAPES) and all(decoded[n].shape == SHAPES[n] for n in SHAPES)


def test_a_state_file_reads_back_as_state_from_bytes_does(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    state = train.OuterState(params=_random(g, 1.0, SMALL), momentum=_random(g, 0.1, SMALL))
    path = tmp_path / "s.state"
    with open(path, "wb") as f:
        for piece in train.state_chunks(state):
            f.write(piece)
    assert path.read_bytes() == train.state_to_bytes(state)
    loaded = train.state_from_file(path, like=train.template(state))
    assert _bits(loaded) == _bits(state) and list(loaded.params) == list(state.params)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(train.CheckpointError, match="body is"):
        train.state_from_file(path, like=train.template(state))


# Run in a fresh process per count: peak RSS is what is measured, and an allocator keeps
# what one measurement freed for the next. The executor applies a round of N deltas of a
# 1.7M-parameter charlm given as bytes (old and new code take those), a thread sampling
# /proc/self/statm; prints the peak above the resident set just before the call.
_CHILD = r"""
import os, sys, threading, time
import trio, torch
from ttpeer import train
from ttpeer.daemon import Home
from ttpeer.daemon.worker._torch import TorchExecutor
from ttpeer.proto import JobSpec, sign

N = int(sys.argv[2])
SPEC = {"task": "charlm:n_layer=2,d_model=256,n_head=4,block_size=32", "mode": "fused", "rounds": 2, "shards": N,
        "batches": 1, "batch_size": 2, "inner_lr": 0.01, "weight_decay": 0.0, "outer_lr": 0.7,
        "outer_momentum": 0.9, "bits": 8, "seed": 0, "lease": 5.0, "steal": False}

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

async def main():
    home = Home(__import__("pathlib").Path(sys.argv[1]))
    home.create_pool("https://127.0.0.1:1", "0" * 64, "a", time.time())
    ex = TorchExecutor(home)
    fixed, init = await ex.new_job(SPEC, None)
    body = {**SPEC, **fixed, "init_blob": "0" * 64, "task_blob": "", "at": int(time.time())}
    job = JobSpec.of(sign("job", home.config().pool, body, home.node_key()))
    assert await ex.prepare(job, None) is None
    assert await ex.import_state(job, fixed["init"], init)
    base = ex._state(job, fixed["init"])
    g = torch.Generator().manual_seed(0)
    one = train.encode_delta({k: torch.randn(v.shape, generator=g) * 0.01 for k, v in base.params.items()}, None)[0]
    deltas = [(one, 2) for _ in range(N)]  # one blob N times: the same bytes, decoded N times
    params = sum(t.numel() for t in base.params.values())
    peak, stop = [0], threading.Event()
    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.0005)
    before = rss()
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    await ex.apply(job, fixed["init"], deltas, "sha256:" + "0" * 64, rnd=0)
    stop.set()
    t.join()
    print(params, max(peak[0], rss()) - before)

trio.run(main)
"""


def _peak_above(tmp_path: Path, n: int) -> tuple[int, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / f"home{n}"), str(n)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    params, peak = out.stdout.split()
    return int(params), int(peak)


@pytest.mark.slow
def test_memory_of_a_round_does_not_grow_with_its_contributions(tmp_path: Path) -> None:
    params, two = _peak_above(tmp_path, 2)
    _params, sixteen = _peak_above(tmp_path, 16)
    # Held all at once, 14 more decoded deltas are 56 bytes/parameter more; one at a time,
    # the peak (the sum, the new state, one delta's temporaries) is the same for any count.
    print(f"2 deltas: +{two / params:.1f} B/param, 16: +{sixteen / params:.1f} B/param")
    assert sixteen - two < 8 * params, f"2 deltas: +{two / params:.1f} B/param, 16: +{sixteen / params:.1f} B/param"


def test_a_state_file_streamed_tensor_by_tensor_gives_the_hash_and_outer_step_of_the_state(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(4)
    state = train.OuterState(params=_random(g, 1.0, SMALL), momentum=_random(g, 0.1, SMALL))
    path = tmp_path / "s.state"
    path.write_bytes(train.state_to_bytes(state))
    like = train.template(state)
    assert train.file_state_hash(path) == train.state_hash(state)
    assert [n for n, _p, _m in train.iter_state_file(path, like)] == list(state.params)
    deltas = [(_random(g, 0.01, SMALL), samples) for samples in (5, 0, 9)]
    total = train.OuterSum(like, [s for _d, s in deltas])  # a template: the base comes from the file
    for delta, _s in deltas:
        total.add(delta)
    streamed = total.step(lr=0.7, momentum=0.9, base=train.iter_state_file(path, like))
    assert _bits(streamed) == _bits(train.outer_step(state, deltas, lr=0.7, momentum=0.9))
    path.write_bytes(path.read_bytes()[:-4] + b"\0\0\0\1")  # one value changed: another hash
    assert train.file_state_hash(path) != train.state_hash(state)
