"""The relay refuses a revoked peer: over real TLS, at once, for every later login,
and after a restart; a revocation not signed by the pool root is refused."""

from __future__ import annotations

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ttpeer.net import RelayClient, RelayRejected
from ttpeer.proto import pool_id_of, public_hex, sign

from .test_relay import Pool, RelayConfig, member, serve


def _pool_with_root() -> tuple[Pool, Ed25519PrivateKey]:
    root = Ed25519PrivateKey.generate()
    pool = pool_id_of(public_hex(root))
    invite_key = Ed25519PrivateKey.generate()
    body = {"key": public_hex(invite_key), "expires": 2**40, "uses": 100, "role": "member"}
    return Pool(pool, sign("invite", pool, body, root), invite_key), root


async def test_revoked_peer_is_refused_now_on_every_login_and_after_a_restart(tmp_path) -> None:
    pool, root = _pool_with_root()
    bob_key, bob_proof = pool.member("bob")
    bob_id = public_hex(bob_key)
    revoke = sign("revoke", pool.id, {"node": bob_id, "keep": [], "at": 1}, root)
    forged = sign("revoke", pool.id, {"node": bob_id, "keep": [], "at": 1}, bob_key)
    config = RelayConfig(data=tmp_path / "relay", listen="127.0.0.1:0")
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        running = await nursery.start(lambda task_status: serve(config, shutdown_trigger=stop.wait,
                                                                task_status=task_status))
        async with member(running, pool, "alice") as alice, member(running, pool, "bob",
                                                                   identity=(bob_key, bob_proof)) as bob:
            assert len(await alice.roster()) == 2
            with pytest.raises(RelayRejected, match="bad revocation"):
                await alice.revoke(forged.raw)  # signed by a member, not the root
            await bob.send(public_hex(bob_key), b"still in")  # the forged one changed nothing
            await alice.revoke(revoke.raw)
            with pytest.raises(RelayRejected, match="revoked") as refused:
                await bob.send(public_hex(bob_key), b"x")  # its open session is refused at once
            assert refused.value.status == 403
            assert bob_proof not in await alice.roster()
        fresh = RelayClient(running.url, running.fingerprint, pool=pool.id, peer_key=bob_key, proof=bob_proof)
        with pytest.raises(RelayRejected, match="revoked"):
            await fresh.connect()  # a new login too
        await fresh.aclose()
        stop.set()  # the first relay shuts down; a second one starts on the same data
        again = RelayConfig(data=tmp_path / "relay", listen="127.0.0.1:0")
        second = await nursery.start(serve, again)
        later = RelayClient(second.url, second.fingerprint, pool=pool.id, peer_key=bob_key, proof=bob_proof)
        with pytest.raises(RelayRejected, match="revoked"):
            await later.connect()  # the revocation was saved with the roster
        await later.aclose()
        nursery.cancel_scope.cancel()
