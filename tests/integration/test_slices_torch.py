"""Aggregation slices with real torch: three ``Node``s with ``TorchExecutor`` over the
in-memory relay train a ``chunk`` job of the built-in mnist1d MLP (about 79k parameters,
20 chunks of 4096). Rounds of three authors close from reduced slices; every peer ends
bit-identical, and the sliced mean is the all-deltas mean re-quantized.

A shard of this model trains in milliseconds, so one peer could take a whole round before
the others claim (under CI's load all five rounds once went to two peers and none was
sliced). ``_Gated`` holds each peer's shard of a round until all three have begun one, so
a round has three authors unless a peer's claim then loses a concurrent claim and the
others finish the rest first (seen under the full suite's load in 2 of 5 rounds, and once
in 4 of 5: six rounds, so that two sliced ones are likely under load). What the peers
train is unchanged."""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path

import trio

from ttpeer.daemon import Home, Node, new_invite
from ttpeer.daemon.worker._torch import TorchExecutor
from ttpeer.net import MemoryRelay
from ttpeer.proto import Timing, Token, Train, _slices

RELAY, FP = "https://relay.test.invalid", "sha256:" + "0" * 64
SPEC = {"task": "mnist1d:samples=2000", "mode": "fused", "batch_size": 32, "inner_lr": 0.003, "weight_decay": 0.0,
        "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8, "seed": 3, "lease": 20.0, "rounds": 6, "shards": 6,
        "batches": 6, "steal": False, "chunk": 4096, "slice_bits": 3}


class _Gated(TorchExecutor):
    """The real executor, except that a peer's training of round r waits until every
    peer has begun a shard of round r, or until its claim is lost (``should_stop``)."""

    def __init__(self, home: Home, started: dict[int, set[str]], changed: list[trio.Event], peers: int):
        super().__init__(home)
        self._name, self._started, self._changed, self._peers = home.path.name, started, changed, peers

    async def train(self, eff: Train, should_stop):
        self._started.setdefault(eff.round, set()).add(self._name)
        self._changed[0].set()
        self._changed[0] = trio.Event()
        while len(self._started[eff.round]) < self._peers and not should_stop():
            with trio.move_on_after(0.2):  # should_stop is polled, as the real trainer does between batches
                await self._changed[0].wait()
        return await super().train(eff, should_stop)


def _homes(root: Path, n: int) -> list[Home]:
    admin = Home(root / "p0")
    cfg = admin.create_pool(RELAY, FP, "p0", time.time())
    homes = [admin]
    for i in range(1, n):
        invite, key = new_invite(admin.root_key(), cfg.pool, ttl=60, uses=1, role="member", now=time.time())
        home = Home(root / f"p{i}")
        home.enroll(Token((RELAY,), FP, cfg.pool, invite, key.private_bytes_raw()), f"p{i}", time.time())
        homes.append(home)
    return homes


async def test_three_torch_peers_close_sliced_rounds_and_end_bit_identical(tmp_path, monkeypatch):
    # Every slice checked: each result is reproduced on one chunk (drawn by its checker,
    # reduced alone with torch) by a second peer before it counts.
    monkeypatch.setattr(_slices, "CHECK_ONE_IN", 1)
    homes = _homes(tmp_path, 3)
    async with MemoryRelay() as relay:
        started: dict[int, set[str]] = {}
        changed = [trio.Event()]
        nodes = [Node(h, relay.client(h.config().pool, h.node_key(), h.config().proof),
                      _Gated(h, started, changed, len(homes)),
                      timing=Timing(digest_interval=0.5)) for h in homes]
        with trio.fail_after(240):
            async with trio.open_nursery() as nursery:
                for node in nodes:
                    await nursery.start(node.run)
                job = await nodes[0].submit(SPEC, None)
                for node in nodes:
                    await node.done_event(job.id).wait()
                nursery.cancel_scope.cancel()
    finals = {hashlib.sha256((h.path / "states" / job.id / "final.safetensors").read_bytes()).hexdigest()
              for h in homes}
    assert len(finals) == 1
    records = nodes[0].machine.records
    chain = nodes[0].machine.chain(job)
    sliced = [c for c in chain.closes if "slices" in c.body]
    assert len(sliced) >= 2, "rounds of three authors are reduced in slices"
    for close in chain.closes:  # a round of two authors (above) closes from all deltas
        authors = {records.by_id[i].author for i in close["contribs"]}
        assert ("slices" in close.body) == (len(authors) == 3), (len(authors), close.body.get("slices"))
    for close in sliced:
        named = [records.by_id[s] for s in close["slices"]]
        assert [(r["first"], r["stop"]) for r in named] == [(0, 7), (7, 14), (14, 20)]
        # A slice holds its chunks' 3-bit values and scales: a third of an int8 delta's bytes,
        # not a model's (checked: 0.32x; 0.46x at 4 bits, 1.0x-1.2x at 8).
        contrib = records.by_id[close["contribs"][0]]
        assert sum(r["size"] for r in named) < 0.4 * contrib["size"], (sum(r["size"] for r in named), contrib["size"])
        assert all(c.body.get("chunks") == 20 for c in (records.by_id[i] for i in close["contribs"]))
        for r in named:  # each signed by its reducer and by a checker
            assert len({x.author for x in records.of_job(job.id, "slice") if x["sha256"] == r["sha256"]}) == 2
    checks = [n.counters.job(job.id) for n in nodes]
    assert sum(c.samples for c in checks) >= sum(len(c["slices"]) for c in sliced)
    assert sum(c.sample_misses for c in checks) == 0
    losses = [c["metrics"]["eval_loss"] for c in chain.closes]
    # The mean is sane: never far above chance (ln 10 = 2.30) and well below it in some
    # round. The rounds swing with the outer momentum (0.9): 1.9-2.1 in most runs, 2.22
    # once and 2.34 once (the second round, the rest 1.67-2.05) under the full suite's load,
    # as which peers cover a round varies with timing; with four runs at once on two cores
    # the last round ended at 2.0008-2.028 in 3 of 96, so the last round is no guard. A
    # broken mean (a slice's values misplaced or mis-scaled) diverges far above chance.
    assert max(losses) < 1.1 * math.log(10), losses
    assert min(losses) < 2.0, losses
