"""The relay keeps refusing a revoked peer after a restart: the revocation is saved with
the roster; so is the acknowledgement that used a token up. (That it refuses them at once
and at every login, and refuses records not signed by the pool root, is
``test_relay_contract.py``, on both relays.)"""

from __future__ import annotations

import pytest
import trio
from ttpeer_wire import ErrorCode

from ttpeer.net import RelayClient, RelayRejected
from ttpeer.proto import public_hex, sign

from .test_relay import Pool, RelayConfig, member, serve


async def test_a_revoked_peer_is_refused_after_a_relay_restart(tmp_path, pool: Pool) -> None:
    assert pool.root is not None
    bob_key, bob_proof = pool.member("bob")
    revoke = sign("revoke", pool.id, {"node": public_hex(bob_key), "keep": [], "at": 1}, pool.root)
    config = RelayConfig(data=tmp_path / "relay", listen="127.0.0.1:0")
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        running = await nursery.start(lambda task_status: serve(config, shutdown_trigger=stop.wait,
                                                                task_status=task_status))
        async with member(running, pool, "alice") as alice, member(running, pool, "bob",
                                                                   identity=(bob_key, bob_proof)):
            await alice.revoke(revoke.raw)
        stop.set()  # the first relay shuts down; a second one starts on the same data
        again = RelayConfig(data=tmp_path / "relay", listen="127.0.0.1:0")
        second = await nursery.start(serve, again)
        later = RelayClient(second.url, second.fingerprint, pool=pool.id, peer_key=bob_key, proof=bob_proof)
        with pytest.raises(RelayRejected, match="revoked") as refused:
            await later.connect()  # the revocation was saved with the roster
        assert refused.value.status == 403 and refused.value.code == ErrorCode.REVOKED
        await later.aclose()
        async with member(second, pool, "carol") as carol:
            assert bob_proof not in await carol.roster()
        nursery.cancel_scope.cancel()


async def test_an_acknowledged_join_still_shuts_out_the_tokens_other_joins_after_a_restart(tmp_path,
                                                                                          pool: Pool) -> None:
    from .test_relay_contract import _one_use

    assert pool.root is not None
    (_, _, first), (thief_key, thief_proof, _) = _one_use(pool, ("laptop", "thief"))
    body = {"invite": first["invite"], "join": first.id, "node": first["node"], "name": "laptop", "at": first["at"]}
    admit = sign("admit", pool.id, body, pool.root)
    config = RelayConfig(data=tmp_path / "relay", listen="127.0.0.1:0")
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        running = await nursery.start(lambda task_status: serve(config, shutdown_trigger=stop.wait,
                                                                task_status=task_status))
        async with member(running, pool, "alice") as alice:
            await alice.admit(admit.raw)
        stop.set()
        second = await nursery.start(serve, RelayConfig(data=tmp_path / "relay", listen="127.0.0.1:0"))
        later = RelayClient(second.url, second.fingerprint, pool=pool.id, peer_key=thief_key, proof=thief_proof)
        with pytest.raises(RelayRejected, match="already used by laptop") as refused:
            await later.connect()  # the acknowledgement was saved with the roster
        assert refused.value.code == ErrorCode.TOKEN_USED
        await later.aclose()
        nursery.cancel_scope.cancel()
