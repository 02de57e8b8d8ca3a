"""Canonical encoding: one value, one byte string; anything else is a RecordError."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from ttpeer_wire._codec import MAX_DEPTH, MAX_INT

from ttpeer.proto import RecordError, decode, encode

BIG = 1 << 20

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-MAX_INT, MAX_INT),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)


def values(depth: int) -> st.SearchStrategy[Any]:
    """JSON values nested at most ``depth`` containers deep."""
    if depth == 0:
        return scalars
    inner = values(depth - 1)
    return st.one_of(
        scalars,
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    )


json_values = values(4)
containers = st.one_of(
    st.lists(values(3), min_size=2, max_size=4),
    st.dictionaries(st.text(max_size=8), values(3), min_size=2, max_size=4),
)


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (1 and 1.0 and True differ)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return a == b


def nest(levels: int, leaf: Any = 0) -> Any:
    value = leaf
    for _ in range(levels):
        value = [value]
    return value


# -- round trip ---------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_round_trip_is_exact(value: Any) -> None:
    data = encode(value)
    back = decode(data, max_size=BIG)
    assert same(back, value)
    assert encode(back) == data


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_encoding_is_ascii_sorted_and_compact(value: Any) -> None:
    data = encode(value)
    data.decode("ascii")  # raises if not ASCII
    assert data == json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@given(st.dictionaries(st.text(max_size=6), st.integers(-MAX_INT, MAX_INT), min_size=2, max_size=6))
def test_equal_dicts_encode_identically_whatever_their_insertion_order(d: dict[str, int]) -> None:
    reordered = dict(reversed(list(d.items())))
    assert encode(reordered) == encode(d)


def test_nesting_up_to_max_depth_is_accepted_and_beyond_is_refused() -> None:
    ok = nest(MAX_DEPTH)
    assert decode(encode(ok), max_size=BIG) == ok
    with pytest.raises(RecordError):
        encode(nest(MAX_DEPTH + 1))
    with pytest.raises(RecordError):
        decode(json.dumps(nest(MAX_DEPTH + 1)).replace(" ", "").encode(), max_size=BIG)


@pytest.mark.parametrize(
    "value",
    [math.nan, math.inf, -math.inf, [1.0, math.nan], {"a": math.inf}, (1, 2), b"x", {1, 2}, {1: "a"},
     MAX_INT + 1, -MAX_INT - 1, object(), nest(MAX_DEPTH + 3)],
    ids=lambda v: "object()" if type(v) is object else repr(v),  # one id in every process (pytest-xdist)
)
def test_encode_refuses_unsupported_values(value: Any) -> None:
    with pytest.raises(RecordError):
        encode(value)


# -- non-canonical variants ---------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(json_values, st.sampled_from([b" ", b"\n", b"\t", b"\r"]), st.booleans())
def test_outer_whitespace_is_refused(value: Any, ws: bytes, leading: bool) -> None:
    data = encode(value)
    with pytest.raises(RecordError):
        decode(ws + data if leading else data + ws, max_size=BIG)


@settings(max_examples=100, deadline=None)
@given(containers)
def test_spaced_separators_are_refused(value: Any) -> None:
    spaced = json.dumps(value, sort_keys=True, separators=(", ", ": ")).encode()
    assert spaced != encode(value)
    with pytest.raises(RecordError):
        decode(spaced, max_size=BIG)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=6), values(2), min_size=2, max_size=5))
def test_reordered_keys_are_refused(value: dict[str, Any]) -> None:
    unsorted = json.dumps(dict(sorted(value.items(), reverse=True)), separators=(",", ":")).encode()
    assert unsorted != encode(value)
    with pytest.raises(RecordError):
        decode(unsorted, max_size=BIG)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=10), st.characters(min_codepoint=0x20, max_codepoint=0x7E), st.text(max_size=10))
def test_needlessly_escaped_ascii_is_refused(before: str, char: str, after: str) -> None:
    assume(char not in '"\\')
    data = encode({"k": before + char + after})
    escaped = (b'{"k":"' + encode(before)[1:-1] + f"\\u{ord(char):04x}".encode()
               + encode(after)[1:-1] + b'"}')
    assert escaped != data
    assert json.loads(escaped) == json.loads(data)  # same value, different bytes
    with pytest.raises(RecordError):
        decode(escaped, max_size=BIG)


@pytest.mark.parametrize(
    "data",
    [
        b'"\\u0041"', b'{"\\u0061":1}', b'"\\u00E9"', '"é"'.encode(), b'"\\/"',
        b"NaN", b"Infinity", b"-Infinity", b"[NaN]", b'{"a":Infinity}', b"1e999", b"-1e999",
        b"01", b"-0", b"+1", b"1E5", b"1.50", b"1.0e1", b"0.10", b"1.", b".5", str(MAX_INT + 1).encode(),
        b'{"a":1,"a":1}', b'{"b":1,"a":2}', b"[1, 2]", b'{"a": 1}', b" 1", b"1 ", b"[1]\n",
        b"[1]x", b"[1],", b"[1]]", b"{}{}", b"", b"\x00", b"\xff\xfe", b"[", b'"abc', b"tru", b"True", b"null\x00",
        b"[" * (MAX_DEPTH + 2) + b"]" * (MAX_DEPTH + 2),
        b"[" * 200_000 + b"]" * 200_000,
        b"9" * 5000,
    ],
    ids=lambda d: repr(d[:24]),
)
def test_decode_refuses_non_canonical_and_malformed_bytes(data: bytes) -> None:
    with pytest.raises(RecordError):
        decode(data, max_size=1 << 21)


@settings(max_examples=100, deadline=None)
@given(json_values)
def test_decode_refuses_values_over_max_size(value: Any) -> None:
    data = encode(value)
    assert same(decode(data, max_size=len(data)), value)
    with pytest.raises(RecordError):
        decode(data, max_size=len(data) - 1)


# -- fuzz ----------------------------------------------------------------------------


def _decode_or_record_error(data: bytes) -> None:
    try:
        value = decode(data, max_size=4096)
    except RecordError:
        return
    # Whatever is accepted is canonical: it re-encodes to exactly the same bytes.
    assert encode(value) == data


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_decode_random_bytes_raises_only_record_error(data: bytes) -> None:
    _decode_or_record_error(data)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet='[]{}",:0123456789.-+eEtrufalsnNI\\u \n', max_size=120))
def test_fuzz_decode_json_like_text_raises_only_record_error(text: str) -> None:
    _decode_or_record_error(text.encode())


@settings(max_examples=200, deadline=None)
@given(json_values, st.data())
def test_fuzz_decode_mutated_encodings_raises_only_record_error(value: Any, data: st.DataObject) -> None:
    raw = bytearray(encode(value))
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] = data.draw(st.integers(0, 255))
    _decode_or_record_error(bytes(raw))
