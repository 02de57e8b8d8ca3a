"""Ensemble mode with real daemons and real torch in one process: two ``Node``s with
``TorchExecutor`` over the in-memory relay. A peer dies in the middle of a member's
unit; the survivor takes the member over after the lease and continues it from the
member's last published checkpoint: the step count carries on and the final
ensemble is bit-identical to training every member without interruption."""

from __future__ import annotations

from typing import Any

import trio

from ttpeer import train
from ttpeer.daemon import Node
from ttpeer.daemon.worker._torch import TorchExecutor
from ttpeer.net import MemoryRelay
from ttpeer.proto import Timing, Train

from .test_torch_nodes import TASK_FILE, _homes

ROUNDS, H, BATCH = 3, 150, 16
SPEC = {"task": TASK_FILE.name, "mode": "ensemble", "members": 2, "rounds": ROUNDS, "shards": None, "batches": H,
        "batch_size": BATCH, "inner_lr": 0.02, "weight_decay": 0.01, "outer_lr": 0.7, "outer_momentum": 0.9,
        "bits": 8, "seed": 4, "lease": 2.0, "steal": False}  # requeue by lease, not a backup copy


class DiesMidUnit:
    """The real executor, except that the first unit of round 1 or later never ends: the
    peer is killed while it trains it."""

    def __init__(self, inner: TorchExecutor) -> None:
        self._inner = inner
        self.stalled = trio.Event()
        self.unit: tuple[int, int] | None = None  # (round, member) it died in

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def train(self, eff: Train, should_stop: Any) -> int:
        if eff.round >= 1 and not self.stalled.is_set():
            self.unit = (eff.round, eff.shard)
            self.stalled.set()
            await trio.sleep_forever()
        return await self._inner.train(eff, should_stop)


async def _run(node: Node, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
    with trio.CancelScope() as scope:
        task_status.started(scope)
        await node.run()


async def test_a_member_requeued_after_its_peer_dies_continues_from_its_checkpoint(tmp_path):
    homes = _homes(tmp_path)
    victim = DiesMidUnit(TorchExecutor(homes[1]))
    async with MemoryRelay() as relay:
        nodes = []
        for home, executor in zip(homes, [TorchExecutor(homes[0]), victim], strict=True):
            cfg = home.config()
            nodes.append(Node(home, relay.client(cfg.pool, home.node_key(), cfg.proof), executor,
                              timing=Timing(digest_interval=0.5)))
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                scopes = [await nursery.start(_run, node) for node in nodes]
                job = await nodes[0].submit(dict(SPEC), TASK_FILE.read_bytes())
                await victim.stalled.wait()
                # Let its claim reach the survivor first (a claim lost with its sender would
                # be a plain unclaimed unit, not a requeue), then kill it.
                while not any(c.author == nodes[1].me and (c["round"], c["shard"]) == victim.unit
                              for c in nodes[0].machine.records.of_job(job.id, "claim")):
                    await trio.sleep(0.01)
                scopes[1].cancel()  # SIGKILL, in one process: its claim stays, it never renews
                nodes[1].log.close()
                await nodes[0].done_event(job.id).wait()
                nursery.cancel_scope.cancel()

    assert victim.unit is not None
    rnd, member = victim.unit
    machine = nodes[0].machine
    chain = machine.chain(job)
    assert chain.round == ROUNDS
    victim_id, survivor_id = nodes[1].me, nodes[0].me
    claims = [c for c in machine.records.of_job(job.id, "claim") if (c["round"], c["shard"]) == (rnd, member)]
    assert any(c.author == victim_id for c in claims)  # the victim had claimed the unit it died in
    # Every contribution is one member's checkpoint; the survivor published the requeued unit.
    parts = [machine.records.by_id[cid] for close in chain.closes for cid in close["contribs"]]
    assert all(len(p["shards"]) == 1 for p in parts) and len(parts) == ROUNDS * 2
    requeued = [p for p in parts if (p["round"], p["shards"]) == (rnd, [member])]
    assert [p.author for p in requeued] == [survivor_id]
    assert max(c["attempt"] for c in claims if c.author == survivor_id) >= 1

    # The survivor continued the member from its checkpoint: the final ensemble holds every
    # member at ROUNDS * H steps and is bit-identical to uninterrupted training.
    final = train.state_from_bytes((homes[0].path / "states" / job.id / f"{chain.head[7:]}.state").read_bytes())
    assert [train.member_steps(final, i) for i in range(2)] == [ROUNDS * H] * 2
    task = train.load_task(str(TASK_FILE), tmp_path / "data")
    state = train.init_ensemble(task, job["members"])
    assert train.state_hash(state) == job["init"]
    # Members train on the training data less the samples the job holds out for the vote.
    held, kept = train.holdout_split(task.n_train, job["holdout"], job["seed"])
    assert len(held) == job["holdout"] == train.holdout_size(task.n_train) > 0
    for unit in range(ROUNDS):
        ckpts = [(i, train.train_unit(task, state, i, m, unit, H, BATCH, kept=kept)[0])
                 for i, m in enumerate(job["members"])]
        state = train.combine(state, ckpts)  # type: ignore[arg-type]
    assert train.state_hash(state) == chain.head
    # The metrics of the last close are the ensemble's, beside its best member's; the close
    # names each member's count in the vote, picked on the held-out samples.
    assert set(chain.closes[-1]["metrics"]) == {"eval_loss", "accuracy", "best_member"}
    weights = chain.closes[-1]["weights"]
    assert len(weights) == 2 and sum(weights) > 0
    assert weights == train.weigh_members(task, state, held)[0]
    assert (homes[0].path / "states" / job.id / "final.safetensors").exists()
