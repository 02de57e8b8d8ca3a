"""Canonical encoding of the values that records carry.

One value has exactly one encoding: JSON with sorted keys, no whitespace, ASCII
only, no NaN or infinities. ``decode`` accepts only bytes that re-encode to
themselves, so a re-encoded (re-spaced, re-ordered, re-escaped) copy of a record
is refused instead of becoming a second record with a new id. Sizes and nesting
are capped before and during parsing: hostile bytes cost bounded memory.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ._errors import RecordError

MAX_DEPTH = 8
MAX_INT = 2**63 - 1


def encode(value: Any) -> bytes:
    """Encode ``value`` canonically. Raises ``RecordError`` for unsupported values."""
    _check(value, 0)
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def decode(data: bytes, *, max_size: int, canonical: bool = True) -> Any:
    """Decode canonical bytes of at most ``max_size``. Raises ``RecordError``.
    ``canonical=False`` skips the re-encoding check, for envelopes (gossip payloads)
    that are not signed and so have no identity to protect."""
    if len(data) > max_size:
        raise RecordError(f"encoded value is {len(data)} bytes, over the {max_size}-byte cap")
    try:
        text = data.decode("ascii")
        value = json.loads(text, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RecordError(f"not a canonical record encoding: {exc.__class__.__name__}") from None
    if canonical and encode(value) != data:
        raise RecordError("record bytes are not in canonical form (re-encoded or padded)")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"constant {name} is not allowed")


def _check(value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise RecordError(f"value nests deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise RecordError("integer out of range")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RecordError("non-finite float")
        return
    if isinstance(value, list):
        for item in value:
            _check(item, depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise RecordError("object keys must be strings")
            _check(item, depth + 1)
        return
    raise RecordError(f"unsupported value type {type(value).__name__}")
