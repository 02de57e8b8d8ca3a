"""Signed task files: code that runs on every peer must come from the pool's admin.

A task file is Python that every peer imports. The blob a job names therefore
carries the file together with the pool root's Ed25519 signature over the
file's sha256 (``TASK_DOMAIN + pool + hash``, so the signature is valid for
one pool only and can never be confused with a record or login signature).
``open_task`` accepts it only if the signing key hashes to the pool id: no other
member, however trusted with shards, can make every peer run its code.
"""

from __future__ import annotations

import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from ttpeer_wire import RecordError, TtpeerError, decode, encode, pool_id_of, public_hex

TASK_DOMAIN = b"ttpeer/task/v1\n"
MAX_TASK_FILE = 4 * 2**20


class TaskSignatureError(TtpeerError):
    """A task file is unsigned, altered, or signed by a key other than the pool root's."""


def _message(pool: str, task: bytes) -> bytes:
    return TASK_DOMAIN + pool.encode() + b"\n" + hashlib.sha256(task).hexdigest().encode()


def sign_task(root: Ed25519PrivateKey, pool: str, task: bytes) -> bytes:
    """The blob for ``task``: the file and the root's signature over its hash."""
    if len(task) > MAX_TASK_FILE:
        raise TaskSignatureError(f"the task file is {len(task)} bytes; at most {MAX_TASK_FILE} are allowed")
    if pool_id_of(public_hex(root)) != pool:
        raise TaskSignatureError("only the pool admin (the machine holding root.key) can sign a task file")
    return encode({"task": task.hex(), "root": public_hex(root),
                          "sig": root.sign(_message(pool, task)).hex()})


def open_task(pool: str, blob: bytes) -> bytes:
    """The task file inside ``blob`` if the pool root signed it. Raises ``TaskSignatureError``."""
    try:
        obj = decode(blob, max_size=2 * MAX_TASK_FILE + 4096)
    except (RecordError, ValueError):
        raise TaskSignatureError("the task file is not signed (it is not a signed task blob); "
                                 "refusing to run it: only task files signed by the pool admin run") from None
    if type(obj) is not dict or set(obj) != {"task", "root", "sig"} or not all(type(v) is str for v in obj.values()):
        raise TaskSignatureError("the signed task blob is malformed; refusing to run it")
    try:
        task, root, sig = bytes.fromhex(obj["task"]), bytes.fromhex(obj["root"]), bytes.fromhex(obj["sig"])
    except ValueError:
        raise TaskSignatureError("the signed task blob is malformed; refusing to run it") from None
    if len(root) != 32 or pool_id_of(root.hex()) != pool:
        raise TaskSignatureError("the task file is signed by a key that is not the pool admin's root key; "
                                 "refusing to run it")
    try:
        Ed25519PublicKey.from_public_bytes(root).verify(sig, _message(pool, task))
    except (InvalidSignature, ValueError):
        raise TaskSignatureError("the task file was altered after the pool admin signed it "
                                 "(its signature does not verify); refusing to run it") from None
    return task
