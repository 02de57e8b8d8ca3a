"""Signed task files: a task file runs only if the pool root signed its hash."""

from __future__ import annotations

import pytest

from ttpeer.proto import TaskSignatureError, encode, open_task, sign_task

from .proto_helpers import Pool, key

P = Pool("tasks")
TASK = b"def build_task(options):\n    return None\n"


def test_a_root_signed_task_file_opens_byte_for_byte() -> None:
    assert open_task(P.id, sign_task(P.root, P.id, TASK)) == TASK


def test_an_unsigned_task_file_is_refused() -> None:
    with pytest.raises(TaskSignatureError, match="not signed"):
        open_task(P.id, TASK)


def test_an_altered_task_file_is_refused() -> None:
    blob = sign_task(P.root, P.id, TASK)
    altered = blob.replace(TASK.hex().encode(), (TASK + b"import os\n").hex().encode())
    assert altered != blob
    with pytest.raises(TaskSignatureError, match="altered"):
        open_task(P.id, altered)


@pytest.mark.parametrize("signer", ["member", "other-pool-root"])
def test_a_task_file_signed_by_another_key_is_refused(signer: str) -> None:
    k = key("a-member") if signer == "member" else Pool("other").root
    with pytest.raises(TaskSignatureError, match="only the pool admin"):
        sign_task(k, P.id, TASK)  # the honest helper will not even make it
    forged = encode({"task": TASK.hex(), "root": k.public_key().public_bytes_raw().hex(),
                     "sig": k.sign(b"anything").hex()})
    with pytest.raises(TaskSignatureError, match="not the pool admin's root key"):
        open_task(P.id, forged)


def test_a_signature_is_for_one_pool_only() -> None:
    other = Pool("second")
    with pytest.raises(TaskSignatureError, match="not the pool admin's root key"):
        open_task(other.id, sign_task(P.root, P.id, TASK))


@pytest.mark.parametrize("blob", [b"", b"{}", b'{"root":"","sig":"","task":""}', b'{"root":1,"sig":2,"task":3}',
                                  b'{"root":"zz","sig":"","task":""}', b"\xff" * 40])
def test_malformed_blobs_raise_only_task_signature_error(blob: bytes) -> None:
    with pytest.raises(TaskSignatureError):
        open_task(P.id, blob)
