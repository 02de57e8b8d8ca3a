"""A machine whose membership ends is told at once and stops for good: a second machine
with a single-use token the admin saw used already (whichever join id is lower), a
machine that lost a tie-break the admin settled when it came back, and a revoked
machine. Real daemons in the simulator."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import NoReturn

import pytest
import trio
from ttpeer_wire import ErrorCode

from ttpeer.daemon.node._status import snapshot
from ttpeer.errors import MembershipEnded
from ttpeer.net import MemoryRelay, RelayRejected
from ttpeer.proto import parse
from ttpeer.testing import Simulation

USED = "this token was already used by "


def _racers(sim: Simulation) -> tuple[int, int]:
    """Enroll two homes with one single-use token; (lower join id, higher) indexes in
    sim.peers: the lowest id is what breaks a tie the admin has not settled."""
    sim.enroll_racers(["sam", "tom"])
    ids = [parse(sim.peers[i].home.config().proof[1]).id for i in (2, 3)]
    return (2, 3) if ids[0] < ids[1] else (3, 2)


def _join_of(sim: Simulation, i: int) -> str:
    return parse(sim.peers[i].home.config().proof[1]).id


def _acknowledged(node, join: str) -> bool:  # type: ignore[no-untyped-def]
    return any(r.kind == "admit" and r["join"] == join for r in node.machine.records)


async def _until(cond, timeout: float) -> float:  # type: ignore[no-untyped-def]
    """Wait (simulated time) for ``cond()``; returns the simulated seconds it took."""
    start = trio.current_time()
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.1)
    return trio.current_time() - start


@pytest.mark.parametrize("first_is_lower", [True, False], ids=["first-has-the-lower-id", "first-has-the-higher-id"])
async def test_the_machine_that_used_a_token_first_keeps_its_seat(tmp_path, autojump_clock, first_is_lower):
    """The admin online: it acknowledges the first join it sees, and the second machine with
    the same single-use token is told who used it, and stops, whatever the join ids."""
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=11)
        sim.create(2)
        lower, higher = _racers(sim)
        first, second = (lower, higher) if first_is_lower else (higher, lower)
        async with trio.open_nursery() as nursery:
            sim._nursery = nursery
            for i in (0, 1, first):
                await sim.start(i)
            kept, admin = sim.peers[first].node, sim.peers[0].node
            assert kept is not None and admin is not None
            await _until(lambda: kept.pool_key is not None and _acknowledged(admin, _join_of(sim, first)), 60)
            await sim.start(second)
            lost = sim.peers[second].node
            assert lost is not None
            took = await _until(lambda: lost.fatal is not None, timeout=60)
            assert took < 10, took  # at once: the relay refuses it, or one hello and its answer
            assert isinstance(lost.fatal, MembershipEnded)
            assert f"{USED}{sim.peers[first].name} at " in str(lost.fatal), lost.fatal
            # The first machine is a member everywhere and was never told anything of the kind.
            await trio.sleep(10)
            assert kept.fatal is None and sim.peers[first].home.ended() is None
            for p in (sim.peers[0], sim.peers[1], sim.peers[first]):
                assert p.node is not None and kept.me in p.node.machine.records.members
                assert lost.me not in p.node.machine.records.members
            nursery.cancel_scope.cancel()
        # Started again, it is refused at once, and told who used its token.
        peer = sim.peers[second]
        cfg = peer.home.config()
        from ttpeer.daemon import Node
        from ttpeer.testing._fake import FakeExecutor

        again = Node(peer.home, relay.client(cfg.pool, peer.home.node_key(), cfg.proof), FakeExecutor("x", peer.disk),
                     durable=False)
        ended = await _raised(again.run())
        assert isinstance(ended, MembershipEnded) and f"{USED}{sim.peers[first].name} at " in str(ended)


async def test_while_the_admin_is_offline_the_lowest_id_is_provisional_and_the_admin_settles_it(
        tmp_path, autojump_clock):
    """Both machines join while the admin is away: the lowest join id holds the use
    provisionally, the other waits (it is not ended: the admin decides); the admin comes back,
    acknowledges the provisional member, and the other is told and stops."""
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=7)
        sim.create(2)
        lower, higher = _racers(sim)
        async with trio.open_nursery() as nursery:
            sim._nursery = nursery
            for i in (0, 1):
                await sim.start(i)
            await _until(lambda: sim.peers[1].node is not None and sim.peers[1].node.pool_key is not None, 60)
            sim.kill(0)  # the admin goes away; the member holds the pool key and hands it on
            for i in (higher, lower):
                await sim.start(i)
            member, waiting, held = (sim.peers[i].node for i in (1, higher, lower))
            assert member is not None and waiting is not None and held is not None
            await _until(lambda: held.pool_key is not None and held.me in member.machine.records.members, 60)
            await _until(lambda: waiting.me not in member.machine.records.members
                         and len([r for r in member.machine.records if r.kind == "join"]) >= 4, 60)
            await trio.sleep(20)
            assert waiting.fatal is None  # no record says it lost for good yet
            status = snapshot(member)["peers"]
            assert [p["provisional"] for p in status if p["id"] == held.me] == [True]
            await sim.start(0)  # the admin is back
            took = await _until(lambda: waiting.fatal is not None, timeout=60)
            assert took < 15, took
            assert f"{USED}{sim.peers[lower].name} at " in str(waiting.fatal)
            assert held.fatal is None
            await _until(lambda: not [p for p in snapshot(member)["peers"] if p["provisional"]], 30)
            nursery.cancel_scope.cancel()


async def test_a_revoked_daemon_stops_as_soon_as_its_revocation_reaches_it(tmp_path, autojump_clock):
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=5)
        sim.create(3)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            admin, victim = sim.peers[0].node, sim.peers[2].node
            assert admin is not None and victim is not None
            await _until(lambda: victim.pool_key is not None and victim.me in admin.machine.records.members, 60)
            rec = await admin.revoke(victim.me)
            took = await _until(lambda: victim.fatal is not None, timeout=60)
            assert took < 10, took
            assert rec.id in victim.machine.records  # it learnt from the signed record itself
            assert isinstance(victim.fatal, MembershipEnded) and "revoked" in str(victim.fatal)
            assert "revoked" in (sim.peers[2].home.ended() or "")
            nursery.cancel_scope.cancel()


class _Refusing:
    """A relay that refuses this peer at login with ``error``: a ``Transport`` whose every
    call raises it (the daemon gets no further than ``connect``)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def connect(self) -> None:
        await trio.lowlevel.checkpoint()
        raise self.error

    async def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        await trio.lowlevel.checkpoint()
        raise self.error

    send = broadcast = recv = revoke = admit = roster = put_blob = get_blob = has_blob = _refuse

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_the_daemon_knows_a_revocation_by_the_relays_code_not_its_words(tmp_path, autojump_clock):
    from ttpeer.daemon import Node
    from ttpeer.testing._fake import FakeExecutor

    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=3)
        sim.create(2)
        peer = sim.peers[1]

        def node(error: Exception) -> Node:
            return Node(peer.home, _Refusing(error), FakeExecutor("x", peer.disk), durable=False)

        # Reworded, with the code: a revocation, final.
        revoked = RelayRejected("memory://relay", 403, "(reworded) go away", code=ErrorCode.REVOKED)
        ended = await _raised(node(revoked).run())
        assert isinstance(ended, MembershipEnded) and "revoked" in str(ended)
        # The word without the code (an older relay, a proxy): a refusal like any other,
        # raised as it came; the daemon does not take it for the end of its membership.
        worded = RelayRejected("memory://relay", 403, "this peer was revoked from the pool")
        assert await _raised(node(worded).run()) is worded


async def _raised(run: Awaitable[object]) -> BaseException:
    """What ``run`` raised, out of the nurseries' single-exception groups."""
    try:
        await run
    except BaseException as exc:  # whatever it was: the test looks at it
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        return exc
    raise AssertionError("the daemon ran to its end")
