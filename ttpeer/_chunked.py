"""Where a chunked delta (``TTD2``) cuts, without torch: its head, then one frame per chunk;
and whether one run of a reduced slice (``TTD1``) is another's, for a spot check.

The daemon seals a sliced job's delta in these pieces (``net.seal_cut``), so an aggregator
fetches the table, the head and exactly its slice's chunks; ``ttpeer.train`` writes and
checks the format itself (``train._compress``; ``chunk_pieces`` cuts it the same way, and
``tests/unit/test_chunked.py`` holds the two to one layout), a sibling this base module
may not import. A spot check (``run_matches``) reduces one chunk of a slice and compares
its quantized values and block scales with that run of the result: the payload of
``TTD1`` is the block scales (fp32) and then the values (a byte each at 8 bits, two to a
byte below), quantized block by block, so a run that starts on a block holds the same
bytes whether quantized alone or within the slice.
"""

from __future__ import annotations

import struct

import zstandard

MAGIC = b"TTD2"
HEAD = struct.Struct("<4sBIQI")  # magic, bits, block, values, values per chunk
LENGTH = struct.Struct("<Q")  # one per chunk: its compressed frame's bytes
PLAIN_MAGIC = b"TTD1"  # one frame: what a reduced slice is sent as
PLAIN_HEAD = struct.Struct("<4sBIQ")  # magic, bits, block, values


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


def run_matches(whole: bytes | bytearray | memoryview, part: bytes | bytearray | memoryview, at: int) -> bool:
    """Whether ``part``, the values of a run quantized alone, are the values of ``whole``
    from value ``at`` on: the same bits and block, and byte for byte the same block scales
    and quantized values (a spot check of a reduced slice on one chunk). ``at`` starts a
    block; ``part`` ends on a block or where ``whole`` ends. Raises ValueError for bytes
    that are not one ``TTD1`` frame of the size their head states (either of them), or a
    run that does not lie in ``whole`` as said."""
    bits, block, values, payload = _plain(whole)
    pbits, pblock, pvalues, ppayload = _plain(part)
    if (pbits, pblock) != (bits, block):
        return False
    end = at + pvalues
    if at < 0 or at % block or end > values or (end % block and end != values):
        raise ValueError(f"a run of {pvalues} values at {at} is not whole blocks of a slice of {values}")
    scales = 4 * -(-values // block)
    ours = ppayload[:4 * -(-pvalues // block)]
    if payload[4 * (at // block):4 * (at // block) + len(ours)] != ours:
        return False
    if bits == 8:
        return payload[scales + at:scales + end] == ppayload[len(ours):]
    # Two values a byte: ``at`` starts a block, so an even value and a whole byte; the run's
    # last byte holds a padding nibble only where the slice's does too (at its end).
    return payload[scales + at // 2:scales + -(-end // 2)] == ppayload[len(ours):]


def _plain(data: bytes | bytearray | memoryview) -> tuple[int, int, int, bytes]:
    """A ``TTD1`` frame's bits, block, values and decompressed payload (scales, values).
    Raises ValueError for anything else, or a frame that states or yields another size."""
    if len(data) < PLAIN_HEAD.size or bytes(data[:4]) != PLAIN_MAGIC:
        raise ValueError("not a reduced slice (bad magic or shorter than its header)")
    _magic, bits, block, values = PLAIN_HEAD.unpack_from(data)
    if bits not in (3, 4, 8) or block < 1 or block & (block - 1) or values < 1:
        raise ValueError(f"a reduced slice of {values} values, {bits} bits in blocks of {block}")
    size = 4 * -(-values // block) + (values if bits == 8 else -(-values // 2))
    frame = memoryview(data)[PLAIN_HEAD.size:]  # read in place: a slice can be megabytes
    try:
        if zstandard.frame_content_size(frame) != size:
            raise ValueError(f"a reduced slice's frame does not state its {size} bytes")
        payload = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise ValueError(f"a reduced slice's frame does not open: {exc}") from None
    if len(payload) != size:
        raise ValueError(f"a reduced slice's frame holds {len(payload)} bytes, not {size}")
    return bits, block, values, payload
