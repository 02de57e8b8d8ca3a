"""Hostile bytes at every entry point that takes them from the network, fuzzed with
hypothesis: the relay's HTTP handlers (methods, paths, queries, headers, bodies,
through the ASGI app in-process), gossip payloads, sealed envelopes, and whole
relay messages as a daemon receives them (hello, key handover, sealed gossip).

Tokens, records and compressed deltas have their own fuzz tests next to their
other tests (test_proto_token.py, test_proto_records.py, test_train_compress.py);
the SECURITY.md table lists them all. Every property here is "refused with the
module's own error, never a crash, a hang or a 500", with examples bounded so the
file runs in seconds.
"""

from __future__ import annotations

import json
import math
import os
import resource
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from ttpeer_relay.app import RelayApp
from ttpeer_relay.config import RelayConfig
from ttpeer_wire import ErrorCode

from ttpeer.daemon import Home, Node, new_invite
from ttpeer.net import MemoryRelay, NetError, RelayClient, RelayUnavailable
from ttpeer.net._seal import SealError, open_direct, open_sealed, seal, seal_to
from ttpeer.proto import RecordError, Token, encode, parse, public_hex
from ttpeer.proto._gossip import parse_payload
from ttpeer.testing import FakeDisk, FakeExecutor

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- the relay's HTTP handlers, in-process ------------------------------------------------

PEER = "ab" * 32
BLOB = "cd" * 32
OK_STATUSES = {200, 201, 206, 400, 401, 403, 404, 405, 408, 413, 416, 429, 507}


class Answer:
    def __init__(self) -> None:
        self.status: int | None = None
        self.starts = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = b""
        self.done = False

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.starts += 1
            self.status = message["status"]
            self.headers = dict(message["headers"])
        else:
            self.body += message.get("body", b"")
            self.done = not message.get("more_body", False)


def _app(data: Path, **overrides: Any) -> RelayApp:
    fields: dict[str, Any] = {"rate": 1e9, "burst": 10**9, "max_message_bytes": 4096,
                              "max_json_bytes": 1024, "max_blob_bytes": 8192, **overrides}
    return RelayApp(RelayConfig(data=data, **fields), "sha256:" + "0" * 64)


async def _request(app: RelayApp, method: str, path: str, query: bytes,
                   headers: list[tuple[bytes, bytes]], chunks: list[bytes] | None,
                   *, authorized: bool = False, guard: float | None = 120) -> tuple[Answer, int]:
    """One request through the ASGI app; returns the answer and how many body chunks
    the app read. ``chunks=None`` is a body that never ends. ``guard`` is a deadline
    past any long-poll (30 s) or body grace: a hang, not a wait; ``None`` sets none
    (for a mock clock, where the caller checks the virtual time spent instead)."""
    if authorized:
        token = app.sessions.open("ef" * 16, PEER, trio.current_time())
        headers = [*headers, (b"authorization", f"Bearer {token}".encode())]
    read = 0
    answer = Answer()
    if chunks == []:
        chunks = [b""]  # ASGI sends an empty body as one empty message

    async def receive() -> dict[str, Any]:
        nonlocal read
        await trio.lowlevel.checkpoint()
        if chunks is None:
            if answer.done:  # hypercorn closes the connection after a `connection: close` answer
                return {"type": "http.disconnect"}
            read += 1
            return {"type": "http.request", "body": b"\0" * 512, "more_body": True}
        if read < len(chunks):
            read += 1
            return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": method, "path": path, "query_string": query,
             "headers": headers, "client": ("192.0.2.1", 4000), "http_version": "1.1"}
    with trio.fail_after(math.inf if guard is None else guard):
        await app(scope, receive, answer.send)
    return answer, read


paths = st.one_of(
    st.sampled_from(["/v1/health", "/v1/challenge", "/v1/session", "/v1/roster", f"/v1/send/{PEER}",
                     "/v1/broadcast", "/v1/recv", f"/v1/blob/{BLOB}", "/v1/blob/xyz", "/", "/v1/"]),
    st.text(max_size=60).map(lambda t: "/" + t),
)
header_values = st.one_of(st.binary(max_size=60), st.sampled_from(
    [b"0", b"-1", b"99999999999999999999", b"1e3", b" 12", b"bytes=0-", b"bytes=5-2", b"bytes=999999-",
     b"bytes=0-0,2-3", b"Bearer ", b"Bearer x", b"\xff\xfe"]))
headers = st.lists(st.tuples(
    st.one_of(st.sampled_from([b"content-length", b"range", b"authorization", b"content-type"]),
              st.binary(min_size=1, max_size=20)),
    header_values), max_size=6)
json_bodies = st.dictionaries(
    st.sampled_from(["pool", "peer", "nonce", "sig", "proof", "x"]),
    st.one_of(st.none(), st.integers(), st.text(max_size=70), st.just("ef" * 16), st.just(PEER),
              st.lists(st.text(alphabet="0123456789abcdef", max_size=40), max_size=3)),
    max_size=6).map(lambda d: json.dumps(d).encode())
bodies = st.one_of(st.lists(st.binary(max_size=3000), max_size=4),
                   json_bodies.map(lambda b: [b]),
                   json_bodies.map(lambda b: [b[: len(b) // 2], b[len(b) // 2:]]))
queries = st.one_of(st.binary(max_size=60), st.sampled_from(
    [b"after=1&wait=0", b"after=-1", b"wait=nan", b"wait=inf", b"wait=1e308", b"after=99999999999999999999999",
     b"after=x", b"wait=25"]))


@pytest.fixture(scope="module")
def relay_data() -> Path:
    return Path(tempfile.mkdtemp(prefix="ttpeer-fuzz-relay-"))


@FUZZ
@given(method=st.one_of(st.sampled_from(["GET", "POST", "PUT", "HEAD", "DELETE"]), st.text(max_size=8)),
       path=paths, query=queries, headers=headers, chunks=bodies, authorized=st.booleans())
@example(method="POST", path="/v1/challenge", query=b"", headers=[(b"content-length", b"\xb9")],  # '¹' isdigit
         chunks=[b"{}"], authorized=False)
def test_fuzz_relay_handlers_answer_every_request_without_a_500(
    relay_data: Path, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
    chunks: list[bytes], authorized: bool,
) -> None:
    async def main() -> tuple[Answer, float]:
        app = _app(relay_data)
        start = trio.current_time()
        answer, _ = await _request(app, method, path, query, headers, chunks, authorized=authorized, guard=None)
        return answer, trio.current_time() - start

    # Long-polls jump the mock clock; blob writes run in worker threads, so jump only once
    # all is idle. No deadline is pending while such a thread runs, so autojump has nowhere
    # to jump however long it takes in real time (a loaded machine). A fail_after(120) here
    # was such a deadline: a create or fsync over 0.1 s real jumped straight to it and gave
    # a spurious TooSlowError. The virtual time spent is the handler's own waiting, checked
    # below; a handler that waits forever with no deadline at all is left to pytest-timeout.
    answer, waited = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0.1))
    assert waited < 120, f"waited {waited:.0f} s (virtual): past any long-poll (30 s) or body grace, a hang"
    assert answer.starts == 1
    assert answer.status in OK_STATUSES, (answer.status, answer.body[:200])
    if answer.status >= 400:  # words for people, and a code every client knows
        error = json.loads(answer.body)
        assert set(error) == {"error", "code"} and error["code"] in {code.value for code in ErrorCode}


@pytest.mark.parametrize(("path", "authorized", "limit"), [
    ("/v1/challenge", False, 1024), ("/v1/session", False, 1024),
    (f"/v1/send/{PEER}", True, 4096), ("/v1/broadcast", True, 4096), (f"/v1/blob/{BLOB}", True, 8192),
])
def test_endless_bodies_are_refused_413_after_the_cap_not_at_their_end(
    tmp_path: Path, path: str, authorized: bool, limit: int,
) -> None:
    method = "PUT" if "blob" in path else "POST"

    async def main() -> tuple[Answer, int, Answer]:
        app = _app(tmp_path)
        answer, read = await _request(app, method, path, b"", [], None, authorized=authorized)
        # Declared too large: refused before reading any of it.
        declared, read_declared = await _request(app, method, path, b"", [(b"content-length", b"999999999")],
                                                 None, authorized=authorized)
        assert read_declared == 0
        return answer, read, declared

    answer, read, declared = trio.run(main)
    assert answer.status == 413 and declared.status == 413
    assert b"cap" in answer.body and answer.headers.get(b"connection") == b"close"
    # An endless body of 512-byte chunks: refused once past the cap, not read to its end
    # (which never comes); a chunk or two more may be swallowed while the 413 goes out.
    assert limit // 512 < read <= limit // 512 + 3, read


# -- gossip payloads and sealed envelopes --------------------------------------------------

gossip_objects = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**60, 2**60), st.text(max_size=20),
              st.sampled_from(["records", "digest", "t", "r", "ids", "lo", "hi", "a" * 16, "zz"])),
    lambda inner: st.one_of(st.lists(inner, max_size=5),
                            st.dictionaries(st.sampled_from(["t", "r", "ids", "lo", "hi", "x"]), inner,
                                            max_size=5)),
    max_leaves=20,
)


@FUZZ
@given(st.one_of(st.binary(max_size=400), gossip_objects.map(encode)))
def test_fuzz_gossip_payloads_raise_only_record_error(data: bytes) -> None:
    try:
        kind, value = parse_payload(data)
    except RecordError:
        return
    assert kind in ("records", "digest")
    if kind == "records":
        assert all(isinstance(raw, bytes) for raw in value)


KEY = bytes(range(32))


@FUZZ
@given(st.binary(max_size=300), st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=4),
       st.integers(0, 400))
def test_fuzz_sealed_envelopes_open_only_when_untouched(plain: bytes, flips: list[tuple[int, int]],
                                                        cut: int) -> None:
    recipient = X25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
    for sealed, opener in (
        (seal(KEY, b"purpose", plain), lambda d: open_sealed(KEY, b"purpose", d)),
        (seal_to(recipient.public_key().public_bytes_raw(), plain), lambda d: open_direct(recipient, d)),
    ):
        assert opener(sealed) == plain
        hostile = bytearray(sealed)
        for position, xor in flips:
            hostile[position % len(hostile)] ^= xor
        hostile = hostile[:cut] if cut < len(hostile) else hostile
        if bytes(hostile) == sealed:
            continue
        with pytest.raises(SealError):
            opener(bytes(hostile))
    with pytest.raises(SealError):  # a blob sealed for one purpose never opens as another
        open_sealed(KEY, b"other", seal(KEY, b"purpose", plain))


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_random_bytes_never_open(data: bytes) -> None:
    with pytest.raises(SealError):
        open_sealed(KEY, b"purpose", data)
    with pytest.raises(SealError):
        open_direct(X25519PrivateKey.from_private_bytes(bytes(range(1, 33))), data)


# -- whole relay messages, as a daemon receives them ---------------------------------------


class Pair:
    """An admin (holds the pool key) and a member that has joined but not yet got it."""

    def __init__(self, root: Path) -> None:
        now = time.time()
        self.admin_home = Home(root / "admin")
        cfg = self.admin_home.create_pool("https://relay.invalid", "sha256:" + "0" * 64, "admin", now)
        invite, key = new_invite(self.admin_home.root_key(), cfg.pool, ttl=3600, uses=1, role="member", now=now)
        token = Token(("https://relay.invalid",), "sha256:" + "0" * 64, cfg.pool, invite, key.private_bytes_raw())
        self.member_home = Home(root / "member")
        self.member_home.enroll(token, "member", now)
        relay = MemoryRelay()

        async def nodes() -> tuple[Node, Node]:  # a Node reads trio's clock when made
            return self._node(self.admin_home, relay), self._node(self.member_home, relay)

        self.admin, self.member = trio.run(nodes)

    @staticmethod
    def _node(home: Home, relay: MemoryRelay) -> Node:
        cfg = home.config()
        return Node(home, relay.client(cfg.pool, home.node_key(), cfg.proof),
                    FakeExecutor(cfg.name, FakeDisk()), durable=False)


@pytest.fixture(scope="module")
def pair() -> Pair:
    return Pair(Path(tempfile.mkdtemp(prefix="ttpeer-fuzz-nodes-")))


def _hello(home: Home) -> bytes:
    return b"H" + encode({"proof": [p.hex() for p in home.config().proof]})


def _messages(pair: Pair) -> st.SearchStrategy[bytes]:
    admin_key = pair.admin.pool_key
    assert admin_key is not None
    mutate = st.tuples(st.integers(0, 10**6), st.integers(1, 255))

    def mutated(data: bytes) -> st.SearchStrategy[bytes]:
        return st.lists(mutate, min_size=1, max_size=3).map(
            lambda flips: bytes(_flip(data, flips)))

    return st.one_of(
        st.binary(max_size=300),
        st.binary(max_size=300).map(lambda b: b"P" + b),
        st.binary(max_size=300).map(lambda b: b"W" + b),
        st.binary(max_size=300).map(lambda b: b"H" + b),
        st.binary(max_size=300).map(lambda b: b"K" + b),
        gossip_objects.map(lambda o: b"H" + encode(o)),
        mutated(_hello(pair.member_home)),
        mutated(_hello(pair.admin_home)),
        st.just(_hello(pair.admin_home)),
        # Sealed under the real pool key (an insider's payload): the protocol still checks it.
        gossip_objects.map(lambda o: b"P" + seal(admin_key, b"ttpeer/gossip/v1", encode(o))),
        # A want (W) sealed as one, by an insider: its body is checked where it is read.
        gossip_objects.map(lambda o: b"W" + seal(admin_key, b"ttpeer/want/v1", bytes(8) + encode({"want": o}))),
    )


def _flip(data: bytes, flips: list[tuple[int, int]]) -> bytearray:
    out = bytearray(data)
    for position, xor in flips:
        out[position % len(out)] ^= xor
    return out


def test_fuzz_relay_messages_never_break_a_daemon(pair: Pair) -> None:
    genuine = {r.id for home in (pair.admin_home, pair.member_home) for r in map(parse, home.config().proof)}

    @FUZZ
    @given(data=_messages(pair), sender=st.sampled_from([PEER, public_hex(pair.admin_home.node_key())]))
    def check(data: bytes, sender: str) -> None:
        async def main() -> None:
            async with trio.open_nursery() as nursery:
                for node in (pair.admin, pair.member):
                    node.life.nursery = nursery  # effects a message starts run here, then stop
                    before = sum(node.counters.rejected.values())
                    node._on_message(sender, data)  # raises nothing, whatever the bytes
                    refused = sum(node.counters.rejected.values()) - before
                    assert refused in (0, 1)
                    if data[:1] not in (b"P", b"W", b"H", b"K"):
                        assert refused == 1
                nursery.cancel_scope.cancel()

        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        trio.run(main)
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB

    check()
    assert pair.member.pool_key is None  # nothing handed it a key
    for node in (pair.admin, pair.member):  # nothing but records of real hellos was stored
        assert {r.id for r in node.machine.records} <= genuine


def test_forged_key_handover_is_refused_and_the_member_waits_for_a_real_one(pair: Pair) -> None:
    """The relay knows a joining member's sealing key (it is in the public join record)
    and every member's proof, so it can seal a handover of a key of its choosing; only
    the giver's signature, which it cannot make, stops it."""
    member = pair.member
    seal_pub = member.home.seal_key().public_key().public_bytes_raw()
    admin_proof = [p.hex() for p in pair.admin_home.config().proof]
    forged = {"keys": [os.urandom(32).hex()], "to": member.me, "proof": admin_proof, "sig": os.urandom(64).hex()}

    before = member.counters.rejected.get("message: InvalidSignature", 0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            member.life.nursery = nursery
            member._on_message(PEER, b"K" + seal_to(seal_pub, encode(forged)))
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert member.pool_key is None and member.home.pool_key() is None
    assert member.counters.rejected.get("message: InvalidSignature") == before + 1


# -- a hostile relay's answers, as RelayClient reads them ----------------------------------

SPECIAL_ANSWERS = [
    b'{"messages":[{"seq":Infinity,"from":"a","data":""}],"cursor":1}',
    b'{"messages":[{"seq":1,"from":"a","data":"!!"}],"cursor":1}',
    b'{"messages":[],"cursor":NaN}', b'{"messages":[],"cursor":-Infinity}', b'{"messages":{},"cursor":1}',
    b'{"messages":[{"seq":1e400,"from":[],"data":"AA=="}],"cursor":1}', b'{"delivered":true}',
    b'{"delivered":1e400}', b'{"proofs":[["zz"]]}', b'{"proofs":[[1]]}', b'{"proofs":"ab"}',
    b'{"nonce":"' + b"ab" * 32 + b'"}', b'{"nonce":"n","session":"s","limits":{"max_message_bytes":Infinity}}',
    b'{"nonce":"n","session":"s","limits":{"max_message_bytes":NaN,"max_blob_bytes":-1}}',
    b'{"error":1}', b'{"error":"no"}', b"[]", b"null", b"", b"\xff",
]
answers = st.tuples(
    st.sampled_from([200, 201, 204, 206, 301, 400, 401, 403, 404, 408, 413, 416, 429, 500, 503, 507]),
    st.one_of(st.none(), st.sampled_from(["nan", "inf", "-inf", "-1", "1e999", "5", "soon", "0"])),
    st.one_of(st.sampled_from(SPECIAL_ANSWERS), st.binary(max_size=200),
              gossip_objects.map(lambda o: json.dumps(o).encode())),
)


class _Body(httpx.AsyncByteStream):
    """A body that arrives off the wire, as a real server's does (not pre-read)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for start in range(0, len(self.data), 65536):
            yield self.data[start:start + 65536]


def _client(reply: tuple[int, str | None, bytes]) -> RelayClient:
    status, retry, body = reply

    def handler(request: httpx.Request) -> httpx.Response:
        headers = {"retry-after": retry} if retry is not None else {}
        return httpx.Response(status, headers=headers, stream=_Body(body))

    key = Ed25519PrivateKey.from_private_bytes(bytes(32))
    client = RelayClient("https://relay.invalid:1", "sha256:" + "0" * 64, pool="ef" * 16, peer_key=key, proof=[])
    client._http = httpx.AsyncClient(base_url=client.url, transport=httpx.MockTransport(handler))
    client._session = "s"
    return client


@FUZZ
# get_blob reads blobs without httpx: tests/unit/test_relay_download.py fuzzes its answers.
@given(reply=answers, op=st.sampled_from(["recv", "send", "broadcast", "roster", "has_blob", "put_blob", "login"]))
def test_fuzz_hostile_relay_answers_raise_only_net_errors(reply: tuple[int, str | None, bytes], op: str) -> None:
    async def main() -> None:
        client = _client(reply)
        try:
            if op == "recv":
                messages, cursor = await client.recv(0, 0)
                assert type(cursor) is int and all(type(m.seq) is int and type(m.data) is bytes for m in messages)
            elif op == "send":
                await client.send(PEER, b"x")
            elif op == "broadcast":
                assert type(await client.broadcast(b"x")) is int
            elif op == "roster":
                assert all(type(r) is bytes for proof in await client.roster() for r in proof)
            elif op == "has_blob":
                assert type(await client.has_blob(BLOB)) is bool
            elif op == "put_blob":
                await client.put_blob(b"x")
            else:
                await client._login(client._generation)
                assert all(type(v) is int and v >= 0 for v in client._limits.values())
        except NetError as exc:
            retry = getattr(exc, "retry_after", None)
            assert retry is None or 0 <= retry <= 3600  # a sane wait, whatever the header said
        finally:
            await client.aclose()

    trio.run(main)


def test_gzip_bombed_relay_answer_is_cut_off_without_inflating() -> None:
    """httpx would undo Content-Encoding by itself, a whole chunk at a time: 1 GiB of
    zeros gzips to ~1 MiB, so one 64 KiB chunk would inflate to 64 MiB."""
    pack = zlib.compressobj(1, zlib.DEFLATED, 31)  # gzip framing
    zeros = b"\0" * 2**20
    bomb = b"".join(pack.compress(zeros) for _ in range(256)) + pack.flush()  # 256 MiB inflated
    assert len(bomb) < 2 * 2**20

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-encoding": "gzip"}, stream=_Body(bomb))

    async def main() -> None:
        client = _client((200, None, b""))
        assert client._http is not None
        client._http = httpx.AsyncClient(base_url=client.url, transport=httpx.MockTransport(handler))
        with pytest.raises(RelayUnavailable, match="content-encoding 'gzip'"):
            await client.recv(0, 0)
        await client.aclose()

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trio.run(main)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 32 * 1024  # KiB
