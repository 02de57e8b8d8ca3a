"""Gossip payloads: records split under the size cap, digests, hostile payloads."""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttpeer.proto import MAX_RECORD_BYTES, RecordError, encode, sign
from ttpeer.proto._gossip import (
    ID_PREFIX,
    MAX_DIGEST_IDS,
    MAX_PAYLOAD_BYTES,
    digest_payload,
    in_window,
    parse_payload,
    records_payloads,
)

from .proto_helpers import Pool, key, valid_bodies


def unpack(payloads: list[bytes]) -> list[bytes]:
    out: list[bytes] = []
    for p in payloads:
        assert len(p) <= MAX_PAYLOAD_BYTES
        kind, raws = parse_payload(p)
        assert kind == "records"
        out += raws
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, MAX_RECORD_BYTES), max_size=12), st.integers(0, 2**32))
def test_records_payloads_split_under_the_cap_and_round_trip(sizes: list[int], seed: int) -> None:
    rnd = random.Random(seed)
    raws = [rnd.randbytes(n) for n in sizes]
    payloads = list(records_payloads(raws))
    assert unpack(payloads) == raws
    assert (len(payloads) == 0) == (len(raws) == 0)
    # As few payloads as fit: no two neighbours could have been merged.
    for a, b in zip(payloads, payloads[1:], strict=False):
        assert len(a) + len(b) > MAX_PAYLOAD_BYTES - 32


def test_many_small_records_pack_into_few_payloads() -> None:
    pool = Pool("gossip")
    k = key("gossip")
    recs = [sign("claim", pool.id, dict(valid_bodies()["claim"], n=i), k) for i in range(600)]
    payloads = list(records_payloads(r.raw for r in recs))
    assert unpack(payloads) == [r.raw for r in recs]
    hex_bytes = sum(2 * len(r.raw) + 3 for r in recs)
    assert 2 <= len(payloads) <= hex_bytes // (MAX_PAYLOAD_BYTES - 1024) + 1


def test_max_size_records_each_fit_a_payload() -> None:
    raws = [bytes([i]) * MAX_RECORD_BYTES for i in range(5)]
    assert unpack(list(records_payloads(raws))) == raws


ids = st.lists(st.binary(min_size=1, max_size=8).map(lambda b: hashlib.sha256(b).hexdigest()), max_size=50)


@settings(max_examples=60, deadline=None)
@given(ids)
def test_digest_round_trip(record_ids: list[str]) -> None:
    kind, (got, lo, hi) = parse_payload(digest_payload(record_ids))
    assert kind == "digest"
    assert (lo, hi) == (0, 16**8)  # few ids: one window covers the whole id space
    assert got == {i[:ID_PREFIX] for i in record_ids}
    assert digest_payload(record_ids) == digest_payload(list(reversed(record_ids)) + record_ids)


def test_large_digests_cycle_through_windows_that_cover_every_id() -> None:
    many = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(MAX_DIGEST_IDS + 500)]
    seen: set[str] = set()
    windows = []
    for turn in range(4):
        payload = digest_payload(many, turn)
        assert len(payload) <= MAX_PAYLOAD_BYTES
        kind, (got, lo, hi) = parse_payload(payload)
        assert kind == "digest" and len(got) <= MAX_DIGEST_IDS
        assert all(in_window(p, lo, hi) for p in got)
        windows.append((lo, hi))
        seen |= got
    assert seen == {i[:ID_PREFIX] for i in many}  # a few turns compare every id
    assert windows[0] != windows[1]


@pytest.mark.parametrize("obj", [
    [], "records", None, {}, {"t": "records"}, {"t": "records", "r": "ab"}, {"t": "records", "r": ["zz"]},
    {"t": "records", "r": ["abc"]}, {"t": "records", "r": [], "x": 1}, {"t": "digest"},
    {"t": "digest", "ids": ["short"]}, {"t": "digest", "ids": [1]}, {"t": "digest", "ids": "a" * 16},
    {"t": "digest", "ids": ["a" * 16] * (MAX_DIGEST_IDS + 1)}, {"t": "digest", "ids": [], "r": []},
    {"t": "other", "r": []}, {"t": 1},
], ids=lambda o: repr(o)[:40])
def test_malformed_payloads_are_rejected(obj: object) -> None:
    with pytest.raises(RecordError):
        parse_payload(encode(obj))


def test_oversized_payload_is_rejected() -> None:
    big = encode({"t": "records", "r": ["ab" * (MAX_PAYLOAD_BYTES // 2 + 1024)]})
    with pytest.raises(RecordError):
        parse_payload(big)


def test_non_canonical_payload_is_rejected() -> None:
    with pytest.raises(RecordError):
        parse_payload(b'{"t": "digest", "ids": []}')


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_parse_payload_random_bytes_raises_only_record_error(data: bytes) -> None:
    try:
        kind, value = parse_payload(data)
    except RecordError:
        return
    assert kind in ("records", "digest")


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.fixed_dictionaries({"t": st.sampled_from(["records", "digest", "x"]),
                           "r": st.lists(st.one_of(st.text(max_size=20), st.integers(), st.none()), max_size=4)}),
    st.fixed_dictionaries({"t": st.sampled_from(["records", "digest"]),
                           "ids": st.lists(st.one_of(st.text(max_size=20), st.integers()), max_size=4)}),
))
def test_fuzz_parse_payload_shaped_objects_raises_only_record_error(obj: dict) -> None:
    try:
        kind, value = parse_payload(encode(obj))
    except RecordError:
        return
    if kind == "records":
        assert all(isinstance(v, bytes) for v in value)
    else:
        assert all(isinstance(v, str) and len(v) == ID_PREFIX for v in value)


# -- packed payloads ------------------------------------------------------------------


def test_a_packed_payload_reads_as_itself_and_takes_about_half_the_bytes() -> None:
    from ttpeer.proto._gossip import pack, unpack

    ids = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(200)]
    digest = digest_payload(ids)
    packed = pack(digest)
    assert unpack(packed) == (digest, True) and unpack(digest) == (digest, False)
    assert parse_payload(packed) == parse_payload(digest)
    assert len(packed) < 0.6 * len(digest)  # hex prefixes: 4 bits a character
    pool = Pool("pack")
    recs = [sign(kind, pool.id, body, key("pack")).raw for kind, body in valid_bodies().items()]
    for payload in records_payloads(recs):
        assert parse_payload(pack(payload)) == parse_payload(payload)
        assert len(pack(payload)) < 0.7 * len(payload)


def test_a_packed_payload_that_declares_too_much_or_lies_is_refused_before_any_allocation() -> None:
    import zstandard

    from ttpeer.proto._gossip import PACKED, pack

    big = zstandard.ZstdCompressor(write_content_size=True).compress(b" " * (MAX_PAYLOAD_BYTES + 2048))
    with pytest.raises(RecordError, match="declares"):
        parse_payload(big)  # a few bytes on the wire, a quarter megabyte and more unpacked
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(digest_payload([]))
    with pytest.raises(RecordError, match="declares"):
        parse_payload(unsized)
    with pytest.raises(RecordError):
        parse_payload(PACKED + b"\x00" * 20)
    good = pack(digest_payload(["a" * 64]))
    with pytest.raises(RecordError):
        parse_payload(good[:-3])  # cut short
    with pytest.raises(RecordError):
        parse_payload(good + b"extra")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_packed_garbage_raises_only_record_error(data: bytes) -> None:
    from ttpeer.proto._gossip import PACKED

    try:
        parse_payload(PACKED + data)
    except RecordError:
        return


def test_a_packed_payload_inside_a_packed_payload_is_refused() -> None:
    from ttpeer.proto._gossip import pack

    with pytest.raises(RecordError, match="another packed"):
        parse_payload(pack(pack(digest_payload([]))))
