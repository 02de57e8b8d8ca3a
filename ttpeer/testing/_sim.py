"""The deterministic multi-peer simulator.

Real ``Node`` daemons (real records, sealing, record logs on disk, the real
protocol machine) run as tasks in one trio run over an in-memory relay that
drops, duplicates and delays messages by a seeded RNG, with ``FakeExecutor``
standing in for torch. Run it under ``trio.testing.MockClock(autojump_threshold=0)``
and simulated minutes pass in wall-clock seconds; inside ``deterministic(seed)``
a run replays exactly.

Killing a peer cancels its tasks at whatever await it is in, like SIGKILL: what
it had in memory is gone, what it wrote to its home (record log, keys) and its
``FakeDisk`` stay, and ``restart`` brings it back from exactly that.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from ttpeer.daemon import Home, Node, new_invite
from ttpeer.errors import MembershipEnded
from ttpeer.net import MemoryRelay, MultiRelay, Transport
from ttpeer.net._entropy import seeded
from ttpeer.proto import Timing, Token

from ._fake import FakeDisk, FakeExecutor, Gate, GatedTransport

FAKE_RELAY = "https://relay.sim.invalid"


def sim_relay_url(i: int) -> str:
    """The url of the simulation's relay ``i`` (0: ``FAKE_RELAY``)."""
    return FAKE_RELAY if i == 0 else f"https://relay{i}.sim.invalid"

FAKE_FP = "sha256:" + "0" * 64
SIM_EPOCH = 1_800_000_000.0  # the calendar time a simulation starts at (2027-01-15)


@dataclass
class SimPeer:
    name: str
    home: Home
    disk: FakeDisk = field(default_factory=FakeDisk)
    speed: float = 1.0
    node: Node | None = None
    executor: FakeExecutor | None = None
    scope: trio.CancelScope | None = None
    trained: list[tuple[str, int, int]] = field(default_factory=list)
    lives: int = 0
    gate: Gate = field(default_factory=Gate)
    # By task name, how this peer's training of it fails (see FakeExecutor); kept across restarts.
    fails: dict[str, str | Exception] = field(default_factory=dict)
    failures: int = 0  # failed trainings in earlier lives
    forge: bool = False  # every slice it reduces comes out wrong (see FakeExecutor)
    silent: bool = False  # it never finishes reducing a slice

    @property
    def alive(self) -> bool:
        return self.node is not None


class Simulation:
    def __init__(self, root: Path, relay: MemoryRelay, *, seed: int = 0, timing: Timing | None = None,
                 step_time: float = 0.05, more_relays: list[MemoryRelay] | None = None) -> None:
        self.root = root
        self.relay = relay
        # With more relays, every peer talks to all of them through a ``MultiRelay`` (``relay``
        # first, the pool's primary), as a daemon with a pool of several relays does.
        self.relays = [relay, *(more_relays or [])]
        self.seed = seed
        self.timing = timing or Timing(digest_interval=2.0)
        self.step_time = step_time
        self.peers: list[SimPeer] = []
        self._nursery: trio.Nursery | None = None

    # -- set-up ----------------------------------------------------------------------

    def create(self, n: int, speeds: list[float] | None = None) -> None:
        """Enrol ``n`` peers (the first is the admin) without starting them."""
        now = SIM_EPOCH
        admin = Home(self.root / "peer00")
        cfg = admin.create_pool(FAKE_RELAY, FAKE_FP, "peer00", now)
        self.peers.append(SimPeer("peer00", admin))
        for i in range(1, n):
            invite, key = new_invite(admin.root_key(), cfg.pool, ttl=3600, uses=1, role="member", now=now)
            token = Token((FAKE_RELAY,), FAKE_FP, cfg.pool, invite, key.private_bytes_raw())
            home = Home(self.root / f"peer{i:02d}")
            home.enroll(token, f"peer{i:02d}", now)
            self.peers.append(SimPeer(f"peer{i:02d}", home))
        for peer, speed in zip(self.peers, speeds or [1.0] * n, strict=False):
            peer.speed = speed

    def enroll_racers(self, names: list[str], uses: int = 1) -> list[SimPeer]:
        """Enrol homes ``names`` (not started) with one token of ``uses`` uses made now by the
        simulator's calendar (an invite made with time.time() would have expired long before
        SIM_EPOCH, and no racer would ever be handed the key)."""
        now = SIM_EPOCH + trio.current_time()
        admin = self.peers[0].home
        cfg = admin.config()
        invite, key = new_invite(admin.root_key(), cfg.pool, ttl=600, uses=uses, role="member", now=now)
        token = Token((FAKE_RELAY,), FAKE_FP, cfg.pool, invite, key.private_bytes_raw())
        added = []
        for name in names:
            home = Home(self.root / name)
            home.enroll(token, name, now)
            added.append(SimPeer(name, home))
        self.peers += added
        return added

    async def start_all(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        for i in range(len(self.peers)):
            await self.start(i)

    async def start(self, i: int) -> None:
        assert self._nursery is not None
        peer = self.peers[i]
        peer.gate = Gate()
        peer.executor = FakeExecutor(peer.name, peer.disk, speed=peer.speed, step_time=self.step_time, gate=peer.gate,
                                     fails=peer.fails, forge=peer.forge,
                                     silent=peer.silent)
        cfg = peer.home.config()
        key = peer.home.node_key()
        inner: Transport = self.relay.client(cfg.pool, key, cfg.proof)
        if len(self.relays) > 1:
            by_url = {sim_relay_url(i): r for i, r in enumerate(self.relays)}
            inner = MultiRelay([(url, FAKE_FP) for url in by_url],
                               lambda url, _fp: by_url[url].client(cfg.pool, key, cfg.proof))
        transport = GatedTransport(inner, peer.gate)
        peer.node = Node(peer.home, transport, peer.executor, timing=self.timing, seed=self.seed * 1000 + i,
                         durable=False, wall=lambda: SIM_EPOCH + trio.current_time())
        peer.lives += 1
        peer.scope = await self._nursery.start(self._run_peer, peer)

    async def _run_peer(self, peer: SimPeer, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            assert peer.node is not None
            task_status.started(scope)
            try:
                await peer.node.run()
            except* MembershipEnded:
                pass  # the daemon exits (status 3); ``node.fatal`` says why

    def kill(self, i: int) -> None:
        """Stop peer ``i`` at once, like SIGKILL: memory lost, its home and disk kept."""
        peer = self.peers[i]
        if peer.scope is not None:
            peer.scope.cancel()
        if peer.node is not None:
            peer.node.log.close()
        if peer.executor is not None:
            peer.trained += peer.executor.trained
            peer.failures += peer.executor.failures
        peer.node, peer.executor, peer.scope = None, None, None

    def pause(self, i: int) -> None:
        """Freeze peer ``i`` (SIGSTOP): it neither trains nor talks; its clock runs on."""
        self.peers[i].gate.pause()

    def resume(self, i: int) -> None:
        self.peers[i].gate.resume()

    # -- driving ---------------------------------------------------------------------

    async def submit(self, spec: dict[str, Any], via: int = 0) -> str:
        node = self.peers[via].node
        assert node is not None
        return (await node.submit(spec, None)).id

    async def wait_done(self, job: str, timeout: float) -> None:
        """Wait (simulated time) until every live peer finished ``job`` on the same state.
        Peers that finished on a losing fork repair once gossip brings the winner."""
        with trio.fail_after(timeout):
            while True:
                live = [p for p in self.peers if p.alive]
                if all(job in p.disk.finished for p in live) and len({p.disk.finished[job] for p in live}) == 1:
                    return
                await trio.sleep(0.5)

    async def wait_round(self, job: str, rnd: int, timeout: float) -> None:
        with trio.fail_after(timeout):
            while not any(p.node and self.round_of(p, job) >= rnd for p in self.peers):
                await trio.sleep(0.1)

    async def wait_training(self, timeout: float) -> int:
        """The index of a peer other than the first (the submitter) that is training a
        shard, once one is: a victim to kill while it holds a claim."""
        with trio.fail_after(timeout):
            while True:
                for i, p in enumerate(self.peers):
                    if i and p.node and p.node.machine.training:
                        return i
                await trio.sleep(0.01)

    async def watch_rounds(self, job: str, times: list[float], poll: float = 0.05) -> None:
        """Append the simulated time at which each round first closed anywhere."""
        while True:
            rounds = [self.round_of(p, job) for p in self.peers if p.node and not p.gate.paused]
            while rounds and max(rounds) > len(times):
                times.append(trio.current_time())
            await trio.sleep(poll)

    def round_of(self, peer: SimPeer, job: str) -> int:
        assert peer.node is not None
        rec = peer.node.machine.records.by_id.get(job)
        return peer.node.machine.chain(rec).round if rec else -1

    def all_trained(self) -> list[tuple[str, int, int]]:
        out = []
        for p in self.peers:
            out += p.trained + (p.executor.trained if p.executor else [])
        return out


@contextmanager
def deterministic(seed: int) -> Iterator[None]:
    """Make a simulation replayable: inside, every key, pool key and nonce comes from
    ``seed`` (see ``ttpeer.net._entropy``) and trio runs ready tasks in an order drawn
    from ``seed`` (the same switch pytest-trio flips for Hypothesis). Enter it before
    ``trio.run``; a run inside it with the same seed and inputs gives the same records,
    in the same order, at the same simulated times (in one process: set
    PYTHONHASHSEED to replay in another)."""
    run = trio._core._run
    saved = (run._ALLOW_DETERMINISTIC_SCHEDULING, run._r.getstate())
    run._ALLOW_DETERMINISTIC_SCHEDULING = True
    run._r.seed(seed)
    try:
        with seeded(seed):
            yield
    finally:
        run._ALLOW_DETERMINISTIC_SCHEDULING, state = saved
        run._r.setstate(state)
