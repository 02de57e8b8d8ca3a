"""A machine whose membership ends is told at once and stops for good: the loser of a
single-use token's race (whether it joined first and was handed a key, or second and
never was), and a revoked machine. Real daemons in the simulator."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import NoReturn

import pytest
import trio
from ttpeer_wire import ErrorCode

from ttpeer.errors import MembershipEnded
from ttpeer.net import MemoryRelay, RelayRejected
from ttpeer.proto import parse
from ttpeer.testing import Simulation

LOST = "this token enrolled another machine first; ask the admin for a new one"


def _racers(sim: Simulation) -> tuple[int, int]:
    """Enroll two homes with one single-use token; (winner, loser) indexes in sim.peers.
    The lowest join id wins the use, so who wins is known before anyone starts."""
    sim.enroll_racers(["sam", "tom"])
    ids = [parse(sim.peers[i].home.config().proof[1]).id for i in (2, 3)]
    return (2, 3) if ids[0] < ids[1] else (3, 2)


async def _until(cond, timeout: float) -> float:  # type: ignore[no-untyped-def]
    """Wait (simulated time) for ``cond()``; returns the simulated seconds it took."""
    start = trio.current_time()
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.1)
    return trio.current_time() - start


@pytest.mark.parametrize("loser_first", [True, False], ids=["loser-joined-first", "loser-joined-second"])
async def test_the_loser_of_a_token_race_is_told_and_stops(tmp_path, autojump_clock, loser_first):
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=11)
        sim.create(2)
        winner, loser = _racers(sim)
        first, second = (loser, winner) if loser_first else (winner, loser)
        async with trio.open_nursery() as nursery:
            sim._nursery = nursery
            for i in (0, 1, first):
                await sim.start(i)
            node = sim.peers[first].node
            assert node is not None
            # The first racer is a member for now (it is, by the records it holds) and got a key.
            await _until(lambda: node.pool_key is not None, timeout=60)
            await sim.start(second)
            lost = sim.peers[loser].node
            assert lost is not None
            took = await _until(lambda: lost.fatal is not None, timeout=60)
            # At once: one hello and its answer, well inside one digest interval or two.
            assert took < 10, took
            assert isinstance(lost.fatal, MembershipEnded) and LOST in str(lost.fatal)
            assert lost.nursery is not None and lost.nursery.cancel_scope.cancel_called
            assert LOST in (sim.peers[loser].home.ended() or "")
            # The winner is a member everywhere and was never told anything of the kind.
            won = sim.peers[winner].node
            assert won is not None
            await _until(lambda: won.pool_key is not None, timeout=60)
            assert won.fatal is None and sim.peers[winner].home.ended() is None
            admin = sim.peers[0].node
            assert admin is not None
            await _until(lambda: won.me in admin.machine.records.members, timeout=60)
            assert lost.me not in admin.machine.records.members
            nursery.cancel_scope.cancel()
        # Started again, it says so at once, from its own record log, before any connection.
        peer = sim.peers[loser]
        cfg = peer.home.config()
        from ttpeer.daemon import Node
        from ttpeer.testing._fake import FakeExecutor

        again = Node(peer.home, relay.client(cfg.pool, peer.home.node_key(), cfg.proof), FakeExecutor("x", peer.disk),
                     durable=False)
        with pytest.raises(MembershipEnded, match="enrolled another machine first"):
            await again.run()


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

    send = broadcast = recv = revoke = roster = put_blob = get_blob = has_blob = _refuse

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
