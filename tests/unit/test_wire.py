"""ttpeer_wire, the contract the relay and the peers share: its public names, its
purity (nothing but the standard library's pure parts and cryptography), that
ttpeer.proto and the relay use its very objects, and how error answers read."""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

import pytest
import ttpeer_relay.app
import ttpeer_relay.auth
import ttpeer_relay.tls
import ttpeer_wire
from ttpeer_wire import ErrorCode, error_body, read_error

import ttpeer.net
import ttpeer.proto

WIRE = Path(ttpeer_wire.__file__).parent
# What wire code may import: pure standard modules and cryptography. No I/O (os, io,
# pathlib, socket), no clock (time, datetime), no trio, httpx, torch or ttpeer.
ALLOWED = {"__future__", "base64", "binascii", "collections", "collections.abc", "dataclasses", "enum", "hashlib",
           "ipaddress", "json", "math", "re", "typing"}


def test_public_surface() -> None:
    assert sorted(ttpeer_wire.__all__) == sorted([
        "API", "BLOB", "BROADCAST", "CHALLENGE", "HEALTH", "LOGIN_DOMAIN", "MAILBOX_BYTES",
        "MAILBOX_MESSAGES", "MAX_BLOB_BYTES", "MAX_JSON_BYTES", "MAX_KEEP", "MAX_MESSAGE_BYTES",
        "MAX_RECORD_BYTES", "MAX_RELAYS", "MAX_WAIT", "POOL_QUOTA", "PRECISION_CODES", "RECV", "RECV_MAX_BYTES",
        "RECV_MAX_COUNT", "REVOKE", "ROSTER", "SEND", "SESSION", "ErrorCode",
        # blob TTL and touches (the pin of a running job's dataset pieces)
        "BLOB_TTL", "TOUCH", "TOUCH_MAX_BLOBS", "Member", "ProofError",
        "Record", "RecordError", "TtpeerError", "blob_path", "decode", "encode", "error_body",
        "fingerprint", "host_ok", "join_fits_invite", "login_message", "parse", "pool_id_of", "public_hex",
        "read_error", "send_path", "sign", "verify_proof", "verify_revocation",
        # datasets (ttpeer_wire/_dataset.py)
        "DEFAULT_PIECE_SIZE", "MIN_PIECE_SIZE", "dataset_id", "path_problem", "piece_count", "piece_sizes",
        "record_files", "SAMPLE_FORMATS", "samples_hash", "urls_problem", "tar_key",
        # acknowledged joins: the first machine that used a token keeps its place
        "ADMIT", "verify_admit", "token_used_by", "token_used_message", "error_records",
        # the errors of reading tokens, defined below proto so that ttpeer.errors imports no proto
        "TokenError",
        # the join token (ttpeer_wire/_token.py): the client's invite reads it without the protocol
        "Token", "make_token", "parse_token",
    ])
    for name in ttpeer_wire.__all__:
        assert getattr(ttpeer_wire, name) is not None


def test_wire_is_pure() -> None:
    modules = sorted(WIRE.glob("*.py"))
    assert {m.name for m in modules} >= {"__init__.py", "_codec.py", "_records.py", "_proofs.py", "_relay_api.py"}
    for module in modules:
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name in ALLOWED or name.split(".")[0] == "cryptography", (module.name, name)


def test_proto_net_and_the_relay_use_the_wire_objects_themselves() -> None:
    for name in ("Record", "RecordError", "ProofError", "TokenError", "TtpeerError", "Member",
                 "Token", "make_token", "parse_token", "decode", "encode", "parse",
                 "pool_id_of", "public_hex", "sign", "verify_proof", "verify_revocation", "MAX_RECORD_BYTES",
                 "MAX_KEEP", "PRECISION_CODES"):
        assert getattr(ttpeer.proto, name) is getattr(ttpeer_wire, name), name
    assert ttpeer.net.fingerprint is ttpeer.net.fingerprint_of is ttpeer_wire.fingerprint
    assert ttpeer_relay.tls.fingerprint is ttpeer_wire.fingerprint
    assert ttpeer.net.login_message is ttpeer_relay.app.login_message is ttpeer_wire.login_message
    assert ttpeer.net.ErrorCode is ttpeer_wire.ErrorCode
    assert ttpeer_relay.auth.verify_proof is ttpeer_wire.verify_proof
    assert ttpeer_relay.app.MAX_WAIT is ttpeer_wire.MAX_WAIT
    assert issubclass(ttpeer.net.NetError, ttpeer_wire.TtpeerError)


def test_paths_and_fingerprint() -> None:
    peer, blob = "ab" * 32, "cd" * 32
    assert ttpeer_wire.send_path(peer) == f"/v1/send/{peer}" and ttpeer_wire.blob_path(blob) == f"/v1/blob/{blob}"
    assert ttpeer_wire.fingerprint(b"der") == "sha256:" + hashlib.sha256(b"der").hexdigest()


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_code_reads_back_as_itself(code: ErrorCode) -> None:
    raw = json.dumps(error_body(code, "some words")).encode()
    got = read_error(raw)
    assert got == (code, "some words") and isinstance(got[0], ErrorCode)


def test_error_answers_of_every_shape_read_safely() -> None:
    # A code this client does not know (a newer relay): kept as it came, the words shown.
    assert read_error(b'{"error": "a new kind of no", "code": "brand_new"}') == ("brand_new", "a new kind of no")
    # No code, or a malformed one (an older relay, a proxy): None, the words kept.
    assert read_error(b'{"error": "this peer was revoked from the pool"}') == (
        None, "this peer was revoked from the pool")
    for code in ("", "UPPER", "has space", 7, None, "x" * 40, ["revoked"]):
        assert read_error(json.dumps({"error": "no", "code": code}).encode()) == (None, "no")
    # Not our JSON at all: the start of the text.
    assert read_error(b"<html>502 Bad Gateway</html>") == (None, "<html>502 Bad Gateway</html>")
    assert read_error(b'["error"]') == (None, '["error"]')
    assert read_error(b"\xff" * 300) == (None, "\ufffd" * 200)
    assert read_error(b"[" * 100_000) == (None, "[" * 200)
    assert read_error(json.dumps({"error": "w" * 2000, "code": "revoked"}).encode()) == (ErrorCode.REVOKED, "w" * 500)
