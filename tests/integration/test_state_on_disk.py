"""A fused job's outer states live on disk (``JobStates``): none is kept
in memory while a shard trains (the local model has the params; the momentum waits for
the close), the delta reads the base's params from its file and the close streams the
base tensor by tensor, with the same bits as the state in memory gave. Host memory of a
57M-parameter job: docs/benchmarks.md, "Host memory of a fused job"."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ttpeer import train
from ttpeer.daemon import Home
from ttpeer.daemon.worker._torch import TorchExecutor
from ttpeer.errors import JobError
from ttpeer.proto import PublishDelta, Train

from .test_overlap_eager import SPEC, _job
from .test_torch_nodes import FP, RELAY, TASK_FILE


async def test_no_state_is_in_memory_while_a_shard_trains_and_the_bits_are_the_old_ones(tmp_path: Path) -> None:
    home = Home(tmp_path / "a")
    home.create_pool(RELAY, FP, "a", time.time())
    executor = TorchExecutor(home)
    job, s0 = await _job(home, executor, {**SPEC, "overlap": 0})
    ctx = executor._jobs[job.id]
    held_while_training: list[int] = []

    def stop() -> bool:  # asked in the training thread before every batch
        held_while_training.append(ctx.states.in_memory)
        return False

    samples = await executor.train(Train(job, 0, 0, 0, s0, fresh=True), stop)
    # Main kept the round's base (params and outer momentum, 8 bytes a parameter) here.
    assert held_while_training and set(held_while_training) == {0}
    base = train.state_from_file(ctx.states.file(s0), like=ctx.states.like)
    local = train._state.floating_state(ctx.trainer.model)
    data, _ = await executor.delta(PublishDelta(job, 0, s0, (0,), samples))
    # The delta as ``InnerTrainer.delta`` took it from the state in memory, encoded the same.
    assert data == train.encode_delta({n: base.params[n] - local[n] for n in base.params}, None, bits=8)[0]
    assert not ctx.states.in_memory

    state, metrics = await executor.aggregate(job, s0, [(data, samples), (data, 3)], rnd=0)
    decoded = train.decode_delta(data, ctx.states.like)
    new = train.outer_step(base, [(decoded, samples), (decoded, 3)], lr=train.outer_lr(job.body, 0),
                           momentum=SPEC["outer_momentum"], nesterov=True)
    assert state == train.state_hash(new) and not ctx.states.in_memory
    assert metrics["eval_loss"] == round(ctx.trainer.evaluate(new.params)[0], 6)
    assert await executor.apply(job, s0, [(data, samples), (data, 3)], state, rnd=0)

    # A state file whose bytes changed is still found corrupt by an executor that did not write it.
    path = ctx.states.file(state)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40
    path.write_bytes(bytes(raw))
    other = TorchExecutor(home)
    assert await other.prepare(job, TASK_FILE.read_bytes()) is None
    with pytest.raises(JobError, match="is corrupt"):
        other._state(job, state)


async def test_a_fused_close_drops_the_new_outer_momentum_before_it_evaluates(tmp_path: Path) -> None:
    # The close's peak is the evaluation model beside the trainer's: the new state's outer
    # momentum (4 bytes a parameter) must be gone by then, held only in its file.
    import gc
    import weakref

    home = Home(tmp_path / "a")
    home.create_pool(RELAY, FP, "a", time.time())
    executor = TorchExecutor(home)
    job, s0 = await _job(home, executor, {**SPEC, "overlap": 0})
    ctx = executor._jobs[job.id]
    samples = await executor.train(Train(job, 0, 0, 0, s0, fresh=True), lambda: False)
    data, _ = await executor.delta(PublishDelta(job, 0, s0, (0,), samples))
    made: list[weakref.ref] = []
    alive_at_evaluation: list[int] = []
    outer, evaluate = ctx.mode.outer, ctx.trainer.evaluate

    def outer_seen(*args, **kwargs):
        new = outer(*args, **kwargs)
        made.extend(weakref.ref(t) for t in new.momentum.values())
        return new

    def evaluate_seen(*args, **kwargs):
        gc.collect()
        alive_at_evaluation.append(sum(r() is not None for r in made))
        return evaluate(*args, **kwargs)

    ctx.mode.outer, ctx.trainer.evaluate = outer_seen, evaluate_seen
    await executor.aggregate(job, s0, [(data, samples)], rnd=0)
    assert made and alive_at_evaluation == [0]
