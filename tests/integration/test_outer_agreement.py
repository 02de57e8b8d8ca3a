"""The figures the pool's outer rule weighs (``proto.agreement``), made by the real executor:
each delta's ``delta_sq`` and each close's ``mean_sq``. Two peers' different deltas agree less
than a delta with itself, which agrees fully; and a close made with the momentum a close
names is the state every peer reproduces."""

from __future__ import annotations

import time
from pathlib import Path

from ttpeer.daemon import Home
from ttpeer.daemon.worker._torch import TorchExecutor
from ttpeer.proto import JobSpec, Outer, PublishDelta, Train, agreement, sign

from .test_torch_nodes import _homes

TASK = "charlm:n_layer=1,d_model=32,block_size=16"
SPEC = {"task": TASK, "mode": "fused", "rounds": 2, "shards": 2, "batches": 6, "batch_size": 8,
        "inner_lr": 3e-3, "weight_decay": 0.0, "outer_lr": 0.7, "outer_momentum": 0.0, "outer_auto": 2,
        "bits": 8, "seed": 3, "lease": 10.0, "steal": True}


async def _peer(home: Home) -> tuple[TorchExecutor, JobSpec, str]:
    executor = TorchExecutor(home)
    fixed, init = await executor.new_job(SPEC, None)
    body = {**SPEC, **fixed, "init_blob": "0" * 64, "task_blob": "", "at": int(time.time())}
    job = JobSpec.of(sign("job", home.config().pool, body, home.node_key()))
    assert await executor.prepare(job, None) is None and await executor.import_state(job, fixed["init"], init)
    return executor, job, fixed["init"]


def _signed(home: Home, kind: str, body: dict) -> object:
    return sign(kind, home.config().pool, body, home.node_key())


async def test_deltas_and_closes_carry_the_figures_of_the_peers_agreement(tmp_path: Path) -> None:
    homes = _homes(tmp_path)
    peers = [await _peer(home) for home in homes[:2]]
    (first, job, base), (second, job1, _) = peers
    assert job.outer_agree
    deltas, figures = [], []
    for shard, (executor, j, _) in enumerate(peers):
        samples = await executor.train(Train(j, 0, shard, 0, base, fresh=True), lambda: False)
        data, metrics = await executor.delta(PublishDelta(j, 0, base, (shard,), samples))
        assert metrics["delta_sq"] > 0
        deltas.append((data, samples))
        figures.append(metrics)

    def contribs(which: list[int]) -> list:
        return [_signed(homes[i], "contrib", {
            "job": job.id, "round": 0, "base": base, "shards": [i], "samples": deltas[i][1], "blob": "ab" * 32,
            "size": len(deltas[i][0]), "metrics": figures[i]}) for i in which]

    def close_of(metrics: dict, parts: list) -> object:
        figures = dict(metrics)  # the executor reports mean_sq among its figures; the close names it apart
        return _signed(homes[0], "close", {"job": job.id, "round": 0, "base": base, "state": base,
                                           "contribs": sorted(c.id for c in parts), "metrics": figures,
                                           "mean_sq": figures.pop("mean_sq")})

    # Two peers' own shards: the mean keeps less than either delta's energy.
    step = Outer(0.7, 0.3)
    new, metrics = await first.aggregate(job, base, deltas, rnd=0, outer=step)
    assert await second.apply(job1, base, deltas, new, rnd=0, outer=step)  # the named momentum: the same bits
    both = contribs([0, 1])
    two = agreement(close_of(metrics, both), both)
    assert two is not None and 0.3 < two < 0.95, two
    # One delta twice: the mean is that delta, so it keeps all of it (8-bit decoding aside).
    twice = [deltas[0], deltas[0]]
    _, same = await second.aggregate(job1, base, twice, rnd=0, outer=step)
    one = contribs([0])
    assert abs(agreement(close_of(same, one), one) - 1.0) < 0.02
    assert two < agreement(close_of(same, one), one)
