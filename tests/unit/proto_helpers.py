"""Builders shared by the ``test_proto_*`` tests: keys, pools, jobs, rounds.

Keys are derived from small integers so every test is reproducible and cheap to
shrink; bodies are built per kind of ``SCHEMAS`` with valid defaults that a test
overrides field by field.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ttpeer_wire import dataset_id

from ttpeer.proto import Record, pool_id_of, public_hex, sign

EXPIRES = 1_000_000


def key(n: int | str) -> Ed25519PrivateKey:
    """A deterministic Ed25519 key for label ``n``."""
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"test-key:{n}".encode()).digest())


@functools.cache
def cert_hex(label: str = "direct") -> str:
    """A self-signed X.509 certificate in hex DER, the same bytes for the same label (an
    Ed25519 key from the label, fixed dates and serial: Ed25519 signs deterministically)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import NameOID

    k = key(f"cert:{label}")
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, label)])
    when = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
            .serial_number(1).not_valid_before(when).not_valid_after(when + datetime.timedelta(days=3650))
            .sign(k, None))
    return cert.public_bytes(serialization.Encoding.DER).hex()


def hex64(label: object) -> str:
    return hashlib.sha256(f"hex:{label}".encode()).hexdigest()


def state(label: object) -> str:
    return "sha256:" + hashlib.sha256(f"state:{label}".encode()).hexdigest()


def seed_of(k: Ed25519PrivateKey) -> bytes:
    return k.private_bytes_raw()


class Pool:
    """A pool: its root key and id, and helpers that sign invites and joins for it."""

    def __init__(self, label: object = "root") -> None:
        self.root = key(f"root:{label}")
        self.id = pool_id_of(public_hex(self.root))

    def invite(
        self, invite_key: Ed25519PrivateKey, *, uses: int = 10, expires: int = EXPIRES,
        role: str = "member", signer: Ed25519PrivateKey | None = None,
    ) -> Record:
        body = {"key": public_hex(invite_key), "expires": expires, "uses": uses, "role": role}
        return sign("invite", self.id, body, signer or self.root)

    def join(
        self, invite: Record, node: Ed25519PrivateKey, *, at: int = 100, name: str = "node",
        signer: Ed25519PrivateKey | None = None, invite_id: str | None = None,
    ) -> Record:
        body = {
            "invite": invite_id or invite.id, "node": public_hex(node),
            "seal": hex64(("seal", public_hex(node))), "name": name, "at": at,
        }
        if signer is None:
            raise ValueError("a join is signed by the invite key: pass signer")
        return sign("join", self.id, body, signer)

    def admit(self, nodes: list[Ed25519PrivateKey], *, uses: int | None = None) -> list[Record]:
        """An invite (signed by root) and one join per node: the records that make them members."""
        ik = key(f"invite-for:{self.id}")
        invite = self.invite(ik, uses=uses or max(1, len(nodes)))
        return [invite] + [self.join(invite, n, name=f"n{i}", signer=ik) for i, n in enumerate(nodes)]


def job_body(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "task": "builtin:linear", "task_hash": hex64("task"), "task_blob": "", "mode": "fused",
        "rounds": 3, "shards": 4, "batches": 2, "batch_size": 8, "inner_lr": 0.001,
        "weight_decay": 0.01, "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8, "seed": 1,
        "init": state("init"), "init_blob": hex64("init-blob"), "lease": 30, "steal": True, "at": 1000,
    }
    body.update(over)
    return body


def dataset_body(label: object = "d", *, name: str = "corpus", piece_size: int = 4096, at: int = 50,
                 files: list[tuple[str, int]] | None = None) -> dict[str, Any]:
    """A valid ``dataset`` body: files (path, size) with made-up piece hashes and blobs."""
    entries = []
    for path, size in files if files is not None else [("a.txt", 5000), ("sub/b.txt", 10)]:
        count = -(-size // piece_size)
        hashes = [hex64((label, path, i)) for i in range(count)]
        entries.append((path, size, hashes))
    return {"name": name, "id": dataset_id(piece_size, entries), "piece_size": piece_size, "at": at,
            "files": [{"path": p, "size": s, "pieces": [[h, hex64(("blob", h))] for h in hs]}
                      for p, s, hs in sorted(entries)]}


def valid_bodies() -> dict[str, dict[str, Any]]:
    """One valid body per kind of ``SCHEMAS``."""
    return {
        "invite": {"key": hex64("ik"), "expires": EXPIRES, "uses": 3, "role": "admin"},
        "join": {"invite": hex64("inv"), "node": hex64("node"), "seal": hex64("seal"), "name": "lap-top_1.x", "at": 5},
        "job": job_body(),
        "claim": {"job": hex64("job"), "round": 2, "shard": 7, "attempt": 1, "n": 3, "done": 1, "rate": 0.5,
                  "backup": True},
        "release": {"job": hex64("job"), "round": 2, "shard": 7, "attempt": 1},
        "contrib": {
            "job": hex64("job"), "round": 0, "base": state(0), "shards": [0, 3, 9], "samples": 640,
            "blob": hex64("blob"), "size": 1234, "metrics": {"loss": 0.25, "steps": 10},
        },
        "close": {
            "job": hex64("job"), "round": 0, "base": state(0), "contribs": sorted([hex64("c1"), hex64("c2")]),
            "state": state(1), "metrics": {"loss": 0.5},
        },
        "ckpt": {"job": hex64("job"), "round": 1, "state": state(1), "blob": hex64("ck"), "size": 99},
        "revoke": {"node": hex64("node"), "keep": sorted([hex64("k1"), hex64("k2")]), "at": 7},
        "admit": {"invite": hex64("inv"), "join": hex64("join"), "node": hex64("node"), "name": "laptop", "at": 8},
        "decline": {"job": hex64("job"), "reason": "needs 2.0 GiB, has 1.0 GiB", "need": 2**31, "have": 2**30},
        "cancel": {"job": hex64("job"), "at": 9},
        "dataset": dataset_body(),
        "dataset_rm": {"dataset": hex64("dataset-record"), "at": 11},
        "direct": {"addrs": ["192.168.1.5:7000"], "cert": cert_hex(), "at": 12},
        "relays": {"relays": [["https://relay.example:8443", "sha256:" + "ab" * 32]], "n": 1, "at": 14},
        "ckpt_want": {"job": hex64("job"), "state": state("s9")},
        "slice": {"job": hex64("job"), "round": 0, "base": state(0), "contribs": sorted([hex64("c1"), hex64("c2")]),
                  "slice": 1, "of": 3, "first": 2, "stop": 4, "blob": hex64("sb"), "sha256": hex64("sp"),
                  "size": 4200},
    }


def contrib(
    pool: str, author: Ed25519PrivateKey, job: Record, rnd: int, base: str, shards: list[int],
    *, samples: int = 64, blob: str | None = None,
) -> Record:
    return sign("contrib", pool, {
        "job": job.id, "round": rnd, "base": base, "shards": sorted(shards), "samples": samples,
        "blob": blob or hex64(("blob", public_hex(author), rnd, base, tuple(shards))), "size": 100,
        "metrics": {},
    }, author)


def close(
    pool: str, author: Ed25519PrivateKey, job: Record, rnd: int, base: str, contribs: list[Record],
    new_state: str,
) -> Record:
    return sign("close", pool, {
        "job": job.id, "round": rnd, "base": base, "contribs": sorted(c.id for c in contribs),
        "state": new_state, "metrics": {},
    }, author)
