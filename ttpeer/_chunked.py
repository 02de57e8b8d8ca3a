"""Where a chunked delta (``TTD2``) cuts, without torch: its head, then one frame per chunk.

The daemon seals a sliced job's delta in these pieces (``net.seal_cut``), so an aggregator
fetches the table, the head and exactly its slice's chunks; ``ttpeer.train`` writes and
checks the format itself (``train._compress``; ``chunk_pieces`` cuts it the same way, and
``tests/unit/test_chunked.py`` holds the two to one layout), a sibling this base module
may not import.
"""

from __future__ import annotations

import struct

MAGIC = b"TTD2"
HEAD = struct.Struct("<4sBIQI")  # magic, bits, block, values, values per chunk
LENGTH = struct.Struct("<Q")  # one per chunk: its compressed frame's bytes


def piece_lengths(data: bytes | bytearray | memoryview) -> list[int]:
    """The byte lengths of a chunked delta's pieces: its head, then each chunk's frame.
    Raises ValueError for bytes that are not one whole chunked delta."""
    if len(data) < HEAD.size or bytes(data[:4]) != MAGIC:
        raise ValueError("not a chunked delta (bad magic or shorter than its header)")
    _magic, _bits, _block, values, chunk = HEAD.unpack_from(data)
    if chunk <= 0 or values <= 0:
        raise ValueError(f"a chunked delta of {values} values in chunks of {chunk}")
    count = -(-values // chunk)
    head = HEAD.size + LENGTH.size * count
    if len(data) < head:
        raise ValueError(f"a chunked delta's head is {head} bytes; it has {len(data)}")
    lengths = [LENGTH.unpack_from(data, HEAD.size + LENGTH.size * c)[0] for c in range(count)]
    if head + sum(lengths) != len(data):
        raise ValueError(f"a chunked delta is {len(data)} bytes; its index says {head + sum(lengths)}")
    return [head, *lengths]


def chunk_span(prefix: bytes | bytearray | memoryview, first: int, stop: int) -> tuple[int, int]:
    """The byte range of chunks ``first`` .. ``stop``-1 in a chunked delta, from its first
    bytes (at least its head). Raises ValueError for a prefix that is not a chunked delta's
    or a run that is not the delta's."""
    if len(prefix) < HEAD.size or bytes(prefix[:4]) != MAGIC:
        raise ValueError("not a chunked delta (bad magic or shorter than its header)")
    _magic, _bits, _block, values, chunk = HEAD.unpack_from(prefix)
    count = -(-values // chunk) if chunk > 0 else 0
    head = HEAD.size + LENGTH.size * count
    if len(prefix) < head or not 0 <= first < stop <= count:
        raise ValueError(f"chunks [{first}, {stop}) of a {count}-chunk delta, from {len(prefix)} bytes")
    lengths = [LENGTH.unpack_from(prefix, HEAD.size + LENGTH.size * c)[0] for c in range(count)]
    begin = head + sum(lengths[:first])
    return begin, begin + sum(lengths[first:stop])
