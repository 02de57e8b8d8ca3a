"""Coverage-guided fuzzing of ttpeer's parsers with atheris (libFuzzer), beyond the
bounded hypothesis tests in tests/unit. Not part of the test suite: run it by hand,
for as long as you like, after ``pip install atheris`` (a wheel exists for CPython
3.11 on x86-64 Linux)::

    python scripts/fuzz/atheris_parsers.py TARGET [libFuzzer flags, e.g. -max_total_time=60 -rss_limit_mb=2048]

TARGET is one of: token, record, codec, gossip, sealed, direct, delta, hello.
Each target feeds the bytes to one parser and lets only that parser's own error
through; anything else (another exception, a crash, memory past -rss_limit_mb, a
run past -timeout) is a finding, which libFuzzer saves as crash-*/oom-*/timeout-*.
"""

from __future__ import annotations

import inspect
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import atheris
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from ttpeer.net._seal import SealError, open_direct, open_sealed, seal, seal_to
from ttpeer.proto import (
    RecordError,
    TokenError,
    decode,
    encode,
    make_token,
    parse,
    parse_token,
    pool_id_of,
    public_hex,
    sign,
)
from ttpeer.proto._gossip import digest_payload, parse_payload, records_payloads
from ttpeer.train._compress import decode_delta, encode_delta
from ttpeer.train._errors import DeltaError
from ttpeer.train._state import OuterState

KEY = bytes(range(32))
X25519 = X25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
LIKE = OuterState(params={"w": torch.zeros(64, 8), "b": torch.zeros(8)},
                  momentum={"w": torch.zeros(64, 8), "b": torch.zeros(8)})


def _token(data: bytes) -> None:
    try:
        parse_token(data.decode("utf-8", "replace"), now=0.0)
    except TokenError:
        pass


def _record(data: bytes) -> None:
    try:
        parse(data)
    except RecordError:
        pass


def _codec(data: bytes) -> None:
    try:
        decode(data, max_size=1 << 16)
    except RecordError:
        pass


def _gossip(data: bytes) -> None:
    try:
        parse_payload(data)
    except RecordError:
        pass


def _sealed(data: bytes) -> None:
    try:
        open_sealed(KEY, b"ttpeer/gossip/v1", data)
    except SealError:
        pass


def _direct(data: bytes) -> None:
    try:
        open_direct(X25519, data)
    except SealError:
        pass


def _delta(data: bytes) -> None:
    try:
        decode_delta(data, LIKE)
    except DeltaError:
        pass


def _hello(data: bytes) -> None:
    # What Node._on_hello does with a hello's body before it trusts anything in it.
    try:
        obj = decode(data, max_size=200_000)
        [parse(bytes.fromhex(p)) for p in obj["proof"]]
    except (RecordError, ValueError, TypeError, KeyError):
        pass


TARGETS: dict[str, Callable[[bytes], None]] = {
    "token": _token, "record": _record, "codec": _codec, "gossip": _gossip, "sealed": _sealed,
    "direct": _direct, "delta": _delta, "hello": _hello,
}


def _instrument_ttpeer() -> None:
    """Instrument every function of ttpeer's loaded modules (instrument_imports misses
    modules loaded through the editable install's finder)."""
    for name, module in list(sys.modules.items()):
        if name == "ttpeer" or name.startswith("ttpeer."):
            for value in list(vars(module).values()):
                functions = [value] if inspect.isfunction(value) else [
                    v for v in vars(value).values() if inspect.isfunction(v)] if inspect.isclass(value) else []
                for function in functions:
                    if function.__module__ == name:
                        atheris.instrument_func(function)


def _seeds(target: str) -> list[bytes]:
    """Valid inputs to start from: random bytes rarely get past json.loads or base64,
    which are C code that gives libFuzzer no coverage to climb."""
    root, invite_key, node = (Ed25519PrivateKey.from_private_bytes(bytes([i]) * 32) for i in (1, 2, 3))
    pool = pool_id_of(public_hex(root))
    invite = sign("invite", pool, {"key": public_hex(invite_key), "expires": 2**40, "uses": 3,
                                   "role": "member"}, root)
    join = sign("join", pool, {"invite": invite.id, "node": public_hex(node), "seal": "ab" * 32,
                               "name": "fuzz", "at": 1}, invite_key)
    gossip = [*records_payloads([invite.raw, join.raw]), digest_payload([invite.id, join.id])]
    delta = {k: torch.full_like(v, 0.01) for k, v in LIKE.params.items()}
    return {
        "token": [make_token(["https://relay.example:8443"], "sha256:" + "0" * 64, invite,
                             invite_key.private_bytes_raw()).encode()],
        "record": [invite.raw, join.raw],
        "codec": [encode({"a": [1, "b", None, True], "c": {"d": 2}})],
        "gossip": gossip,
        "sealed": [seal(KEY, b"ttpeer/gossip/v1", g) for g in gossip],
        "direct": [seal_to(X25519.public_key().public_bytes_raw(), b"hello")],
        "delta": [encode_delta(delta, None, bits=bits, block=16)[0] for bits in (4, 8)],
        "hello": [encode({"proof": [invite.raw.hex(), join.raw.hex()]})],
    }[target]


def main() -> None:
    _instrument_ttpeer()
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(TARGETS)}}} [libFuzzer flags]")
    target = sys.argv[1]
    corpus = Path(tempfile.mkdtemp(prefix=f"ttpeer-fuzz-{target}-"))
    for i, seed in enumerate(_seeds(target)):
        (corpus / f"seed{i}").write_bytes(seed)
    print(f"corpus: {corpus}", file=sys.stderr)
    atheris.Setup([sys.argv[0], *sys.argv[2:], str(corpus)], TARGETS[target])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
