"""A relay that attacks the pool: tampers, forges, replays, drops, delays and
reorders, then behaves. Real daemons in the simulator must refuse every tampered
or forged thing, keep their state whole, and finish on the state an honest
recomputation gives."""

from __future__ import annotations

import hashlib
import json

import pytest
import trio

from ttpeer.daemon.node._node import BLOB
from ttpeer.daemon.node._status import snapshot
from ttpeer.net import Faults
from ttpeer.net._seal import open_sealed
from ttpeer.proto import parse
from ttpeer.testing import HostileRelay, Hostility, Simulation
from ttpeer.testing._hostile import BLOB_ATTACKS, MESSAGE_ATTACKS

from .test_simulator import SPEC, assert_invariants


def _h(*parts: object) -> str:  # FakeExecutor's state function, recomputed here on purpose
    return "sha256:" + hashlib.sha256(repr(parts).encode()).hexdigest()


def _rejected(sim: Simulation, blob: bool) -> int:
    return sum(n for p in sim.peers for what, n in p.node.counters.rejected.items()
               if (what == "blob") == blob)


@pytest.mark.parametrize("seed", [7, 4])
async def test_hostile_relay_then_honest_relay_all_peers_agree(tmp_path, autojump_clock, seed):
    relay = HostileRelay()
    async with relay:
        sim = Simulation(tmp_path, relay, seed=seed)
        sim.create(4)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            # Turn hostile once every peer holds the pool key: a peer without it cannot
            # tell sealed gossip from junk, and drops both unread (so uncounted).
            with trio.fail_after(60):
                while not all(p.node.pool_key for p in sim.peers):
                    await trio.sleep(0.1)
            relay.hostility = Hostility(seed=seed)
            relay.faults = Faults(seed=seed, drop=0.1, duplicate=0.1, delay=0.3, max_delay=1.0)
            job = await sim.submit(SPEC)
            await sim.wait_round(job, 2, timeout=900)  # the pool makes progress under attack
            relay.behave()
            await sim.wait_done(job, timeout=900)

            # Every kind of attack was made, and every tampered or forged message or blob
            # was refused by the peer it reached (messages are read once each: wait for
            # the last ones still in mailboxes).
            for attack in (*MESSAGE_ATTACKS, *BLOB_ATTACKS, "replay"):
                assert relay.injected[attack] > 0, (attack, relay.injected)
            sent_bad = sum(relay.injected[a] for a in MESSAGE_ATTACKS)
            with trio.move_on_after(60):
                while _rejected(sim, blob=False) < sent_bad:
                    await trio.sleep(0.5)
            assert _rejected(sim, blob=False) == sent_bad, (
                relay.injected, [p.node.counters.rejected for p in sim.peers])
            assert _rejected(sim, blob=True) == sum(relay.injected[a] for a in BLOB_ATTACKS)
            shown = [snapshot(p.node)["relay"]["rejected"] for p in sim.peers]  # what `ttpeer status` says
            assert sum(n for r in shown for n in r.values()) == sent_bad + _rejected(sim, blob=True)
            json.dumps(shown)

            assert_invariants(sim, job)
            # Identical hashes, and the right ones: recompute every round from the honest
            # blobs the relay stores, in the order peers apply them.
            node = sim.peers[0].node
            records = node.machine.records
            chain = node.machine.chain(records.by_id[job])
            blobs = relay.blobs[node.cfg.pool]
            for rnd, close in enumerate(chain.closes):
                deltas = [(open_sealed(node.pool_key, BLOB, blobs[records.by_id[c]["blob"]]),
                           records.by_id[c]["samples"]) for c in close["contribs"]]
                assert close["base"] == chain.states[rnd]
                assert _h(chain.states[rnd], deltas) == close["state"] == chain.states[rnd + 1]
            assert {p.disk.finished[job] for p in sim.peers} == {chain.head}

            # No forged record reached any peer's memory or disk, and replays stored nothing twice.
            members = set(records.members)
            for p in sim.peers:
                held = p.node.machine.records
                assert set(held.members) == members and len(members) == 4
                assert all(r.author in members or r.kind in ("invite", "join", "admit") for r in held)
                raws = p.node.log.load()
                assert len(raws) == len(set(raws)) == len(held)
                assert all(parse(raw).id in held for raw in raws)
            nursery.cancel_scope.cancel()
