"""Compressed pseudo-gradients: blockwise absmax quantization + zstd, with error
feedback.

A delta is flattened (tensors in sorted-name order) into one fp32 vector, cut
into blocks of ``block`` values; each block stores one fp32 scale (absmax /
qmax) and one signed integer per value, 8-bit in [-127, 127], 4-bit in [-7, 7] or
3-bit in [-3, 3] (both as two's-complement nibbles, low nibble first, a zero nibble pads
an odd count; zstd then takes the unused nibble values' room back).
What quantization drops is returned as a residual, to be added to the next
round's delta, so the error does not accumulate (error feedback).

Wire formats. ``TTD1``, a header then one zstd frame::

    b"TTD1" | u8 bits | u32 block | u64 numel | zstd( scales <f4 x nblocks | values )

``TTD2``, chunked for random access (``encode_delta(..., chunk=)``): the values cut
into chunks of ``chunk`` values (a power of two, a multiple of ``block``, so blocks
never straddle a chunk), an index of each chunk's compressed length, then one zstd
frame per chunk holding that chunk's scales and values::

    b"TTD2" | u8 bits | u32 block | u64 numel | u32 chunk | u64 length x nchunks
            | zstd( scales | values of chunk 0 ) | zstd( ... chunk 1 ) | ...

A run of chunks can be decoded from its own bytes (``read_index``, ``decode_chunks``):
what an aggregator of one slice of the parameter vector downloads. Both formats hold
the same quantized values, so they decode to the same bits.

Bytes come from other peers, so ``decode_delta`` checks every field against the
local model before decompressing, and decompresses into exactly the size the
header implies: a frame that claims or produces more is refused. Decoding uses
only fp32 multiplies on the CPU, so the same bytes give bit-identical tensors
on every machine.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import zstandard
from torch import Tensor

from ._errors import DeltaError, Diverged
from ._state import OuterState

MAGIC = b"TTD1"
MAGIC_CHUNKED = b"TTD2"
ALLOWED_BITS = frozenset({3, 4, 8})
ALLOWED_BLOCKS = frozenset(1 << k for k in range(4, 17))  # 16 .. 65536
_HEAD = struct.Struct("<4sBIQ")
_CHUNK_HEAD = struct.Struct("<4sBIQI")
_LENGTH = struct.Struct("<Q")
ALLOWED_CHUNKS = frozenset(1 << k for k in range(12, 22))  # 4096 .. 2M values: a frame fits one cut piece
_MAX_WINDOW = 1 << 27  # zstd's own default limit, stated so it cannot drift
_CHUNK_VALUES = 1 << 20  # values quantized at a time: temporaries of a few MB, not of the model


def encode_delta(delta: dict[str, Tensor], residual: dict[str, Tensor] | None, *,
                 bits: int = 8, block: int = 256, level: int = 3,
                 chunk: int | None = None) -> tuple[bytes, dict[str, Tensor]]:
    """Quantize and compress ``delta + residual``; return the bytes and the new
    residual (input minus what the receiver will decode), fp32 CPU. ``chunk``: write
    ``TTD2`` with chunks of that many values; None: ``TTD1``.

    Raises Diverged if the input holds NaN or inf (local training diverged),
    ValueError for bits/block/level/chunk outside the allowed values, an empty delta,
    or a residual whose names or shapes differ from the delta's.
    """
    _check_format(bits, block, chunk)
    if not 1 <= level <= 22:
        raise ValueError(f"zstd level must be in [1, 22], got {level}")
    names = sorted(delta)
    if residual is not None and (residual.keys() != delta.keys() or any(
            residual[n].shape != delta[n].shape for n in names)):
        raise ValueError("residual must have the same names and shapes as the delta")
    shapes = {n: delta[n].shape for n in names}
    # ``delta + residual`` flattened into one buffer, which then becomes the new residual
    # in place: with the int8 values, the only model-sized memory encoding needs.
    flat = torch.empty(sum(delta[n].numel() for n in names), dtype=torch.float32)
    if flat.numel() == 0:
        raise ValueError("cannot encode an empty delta")
    offset = 0
    for n in names:
        part, size = delta[n].detach().to("cpu", torch.float32).reshape(-1), delta[n].numel()
        if residual is not None:
            torch.add(part, residual[n].detach().to("cpu", torch.float32).reshape(-1), out=flat[offset:offset + size])
        else:
            flat[offset:offset + size] = part
        offset += size
    del delta, residual  # the caller's references may be the last ones: drop ours early

    qmax = (1 << (bits - 1)) - 1
    numel = flat.numel()
    q = torch.empty(numel, dtype=torch.int8)
    scales = torch.empty(-(-numel // block), dtype=torch.float32)
    # Chunk by chunk of whole blocks, so the temporaries stay small; every value goes
    # through the same fp32 operations as the whole vector at once (the same bytes).
    span = block * max(1, _CHUNK_VALUES // block)
    for begin in range(0, numel, span):
        end = min(begin + span, numel)
        part = flat[begin:end]
        if not bool(torch.isfinite(part).all()):
            raise Diverged("the pseudo-gradient holds NaN or inf")
        blocks = _pad(part, block).view(-1, block)
        s = blocks.abs().amax(dim=1) / qmax
        # A zero (or underflowed) scale means "all zeros"; divide by 1 instead of 0.
        divisor = torch.where(s > 0, s, torch.ones_like(s))
        qc = (blocks / divisor[:, None]).round().clamp(-qmax, qmax).to(torch.int8).reshape(-1)[:end - begin]
        s = torch.where(s > 0, s, torch.zeros_like(s))
        scales[begin // block:begin // block + len(s)] = s
        q[begin:end] = qc
        part.sub_(_dequantize(qc, s, block))  # what the receiver will not see: the residual
    new_residual: dict[str, Tensor] = {}
    offset = 0
    for name in names:
        size = _numel(shapes[name])
        new_residual[name] = flat[offset:offset + size].view(shapes[name])
        offset += size

    if chunk is not None:
        return _chunked(q, scales, bits=bits, block=block, level=level, chunk=chunk), new_residual
    values = _values_bytes(q.numpy(), bits)
    del q  # the int8 values, the payload and the frame are never all alive at once
    payload = scales.numpy().astype("<f4").tobytes() + values
    del values
    frame = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(payload)
    return _HEAD.pack(MAGIC, bits, block, numel) + frame, new_residual


def quantize(values: Tensor, *, bits: int = 8, block: int = 256, level: int = 3,
             chunk: int | None = None) -> bytes:
    """A flat fp32 vector as delta bytes, without error feedback (what a reduced slice
    is sent as). Raises Diverged for NaN or inf, ValueError as ``encode_delta``."""
    data, _residual = encode_delta({"v": values.reshape(-1)}, None, bits=bits, block=block, level=level,
                                   chunk=chunk)
    return data


def _check_format(bits: int, block: int, chunk: int | None) -> None:
    if bits not in ALLOWED_BITS or block not in ALLOWED_BLOCKS:
        raise ValueError(f"bits must be in {sorted(ALLOWED_BITS)} and block a power of two "
                         f"in [16, 65536], got bits={bits}, block={block}")
    if chunk is not None and (chunk not in ALLOWED_CHUNKS or chunk % block):
        raise ValueError(f"chunk must be a power of two in [4096, 2097152] and a multiple of "
                         f"the block ({block}), got {chunk}")


def _chunked(q: Tensor, scales: Tensor, *, bits: int, block: int, level: int, chunk: int) -> bytes:
    numel = q.numel()
    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    frames = []
    for begin in range(0, numel, chunk):
        end = min(begin + chunk, numel)
        part = scales[begin // block:-(-end // block)].numpy().astype("<f4").tobytes()
        frames.append(compressor.compress(part + _values_bytes(q[begin:end].numpy(), bits)))
    index = b"".join(_LENGTH.pack(len(f)) for f in frames)
    return _CHUNK_HEAD.pack(MAGIC_CHUNKED, bits, block, numel, chunk) + index + b"".join(frames)


def _values_bytes(q: np.ndarray, bits: int) -> bytes:
    return q.tobytes() if bits == 8 else _pack_nibbles(q)


def decode_delta(data: bytes | bytearray | memoryview, like: OuterState) -> dict[str, Tensor]:
    """Decode bytes from ``encode_delta`` into tensors shaped like ``like.params``
    (``like`` may be a template on the meta device: only names and shapes are read).

    Deterministic across machines. Raises DeltaError if the bytes are short, the
    magic, bits or block is not allowed, the element count differs from the
    model's, the zstd frame is malformed, declares or yields any size but the
    exact expected one, or has trailing data, a scale is negative or not
    finite, a value is outside the quantization range, or the result is not
    finite.
    """
    out = dict(iter_delta(data, like))
    return {name: out[name] for name in like.params}


def iter_delta(data: bytes | bytearray | memoryview, like: OuterState) -> Iterator[tuple[str, Tensor]]:
    """``decode_delta`` one tensor at a time, in sorted-name order: a caller that adds
    each tensor to a sum never holds the whole decoded delta. The bytes are checked
    before the first tensor; a tensor that decodes to NaN or inf raises DeltaError
    when it is reached (what was yielded before it is then to be thrown away)."""
    names, q_np, scales_np, block = _payload(data, like)
    scales = torch.from_numpy(scales_np)
    offset = 0
    for name in names:
        shape = like.params[name].shape
        size = like.params[name].numel()
        first, last = offset // block, (offset + size - 1) // block
        # Each value times its block's scale: the same single fp32 multiply as the whole
        # flat vector at once, so the same bits.
        per_value = scales[first:last + 1].repeat_interleave(block)
        lead = offset - first * block
        values = torch.from_numpy(q_np[offset:offset + size]).to(torch.float32) * per_value[lead:lead + size]
        if not bool(torch.isfinite(values).all()):
            raise DeltaError("delta decodes to non-finite values (block scale too large)")
        offset += size
        yield name, values.reshape(shape)


@dataclass(frozen=True)
class ChunkIndex:
    """The head of a ``TTD2`` delta, checked (``read_index``): where each chunk's frame lies."""

    bits: int
    block: int
    numel: int
    chunk: int
    lengths: tuple[int, ...]

    @property
    def nchunks(self) -> int:
        return len(self.lengths)

    @property
    def head_size(self) -> int:
        return _CHUNK_HEAD.size + _LENGTH.size * self.nchunks

    @property
    def size(self) -> int:
        """Bytes of the whole delta."""
        return self.head_size + sum(self.lengths)

    def span(self, first: int, stop: int) -> tuple[int, int]:
        """The byte range ``[begin, end)`` of the delta that holds chunks ``first .. stop-1``."""
        self._check(first, stop)
        begin = self.head_size + sum(self.lengths[:first])
        return begin, begin + sum(self.lengths[first:stop])

    def values(self, first: int, stop: int) -> tuple[int, int]:
        """The value range ``[begin, end)`` of the flat vector that chunks ``first .. stop-1`` hold."""
        self._check(first, stop)
        return first * self.chunk, min(stop * self.chunk, self.numel)

    def _check(self, first: int, stop: int) -> None:
        if not 0 <= first < stop <= self.nchunks:
            raise ValueError(f"chunks [{first}, {stop}) are not a run of the delta's {self.nchunks}")

    def _payload_size(self, c: int) -> int:
        count = min(self.chunk, self.numel - c * self.chunk)
        return 4 * -(-count // self.block) + (count if self.bits == 8 else (count + 1) // 2)


CHUNK_HEADER = _CHUNK_HEAD.size  # the bytes of a TTD2 delta that tell ``head_size``


def chunk_pieces(data: bytes | bytearray | memoryview) -> list[bytes]:
    """A ``TTD2`` delta cut where a range fetch wants it: its head, then one piece per
    chunk frame (what ``net.seal_cut`` seals, so piece ``c + 1`` is chunk ``c``). Raises
    DeltaError for bytes that are not a whole chunked delta."""
    head_size(data)  # a chunked delta's header, or DeltaError
    index = read_index(data, _CHUNK_HEAD.unpack_from(bytes(data[:CHUNK_HEADER]))[3])
    if len(data) != index.size:
        raise DeltaError(f"delta is {len(data)} bytes; its index says {index.size}")
    view = memoryview(data)
    return [bytes(view[:index.head_size])] + [bytes(view[slice(*index.span(c, c + 1))]) for c in range(index.nchunks)]


def head_size(prefix: bytes | bytearray | memoryview) -> int:
    """How many leading bytes of a ``TTD2`` delta hold its head (what ``read_index``
    reads), from its first ``CHUNK_HEADER`` bytes. Raises DeltaError for a prefix that
    is short or not a chunked delta; the head itself is checked by ``read_index``."""
    prefix = bytes(prefix[:CHUNK_HEADER])
    if len(prefix) < CHUNK_HEADER or prefix[:4] != MAGIC_CHUNKED:
        raise DeltaError("not a chunked ttpeer delta (bad magic, or shorter than its header)")
    _magic, _bits, _block, numel, chunk = _CHUNK_HEAD.unpack(prefix)
    if chunk not in ALLOWED_CHUNKS:
        raise DeltaError(f"delta has chunks of {chunk} values; not an allowed size")
    return CHUNK_HEADER + _LENGTH.size * -(-numel // chunk)


def read_index(head: bytes | bytearray | memoryview, numel: int) -> ChunkIndex:
    """Check the head of a ``TTD2`` delta (its first ``head_size`` bytes, or more) for a
    model of ``numel`` values. Raises DeltaError if it is short, the magic, bits, block
    or chunk is not allowed, the count differs from ``numel``, or a chunk's compressed
    length is zero or larger than its payload could ever compress to."""
    size = head_size(head)
    _magic, bits, block, count, chunk = _CHUNK_HEAD.unpack_from(head)
    if bits not in ALLOWED_BITS or block not in ALLOWED_BLOCKS or chunk % block:
        raise DeltaError(f"delta uses bits={bits}, block={block}, chunk={chunk}; not an allowed combination")
    if count != numel or count == 0:  # before the size: a forged count never asks for a huge index
        raise DeltaError(f"delta has {count} values; the model has {numel}")
    if len(head) < size:
        raise DeltaError(f"delta head is {len(head)} bytes; its index needs {size}")
    nchunks = (size - CHUNK_HEADER) // _LENGTH.size
    lengths = tuple(_LENGTH.unpack_from(head, CHUNK_HEADER + _LENGTH.size * c)[0] for c in range(nchunks))
    index = ChunkIndex(bits, block, count, chunk, lengths)
    for c, length in enumerate(lengths):
        if not 0 < length <= _frame_bound(index._payload_size(c)):
            raise DeltaError(f"delta chunk {c} claims {length} compressed bytes for a "
                             f"{index._payload_size(c)}-byte payload")
    return index


def decode_chunks(index: ChunkIndex, frames: bytes | bytearray | memoryview, first: int, stop: int) -> Tensor:
    """The values of chunks ``first .. stop-1`` (a flat fp32 vector) from their bytes,
    those at ``index.span(first, stop)``: the same bits as the whole delta decoded. Raises
    DeltaError if the bytes are not exactly that long or a chunk is malformed (as for
    ``decode_delta``)."""
    begin, end = index.span(first, stop)
    frames = memoryview(frames)
    if len(frames) != end - begin:
        raise DeltaError(f"chunks [{first}, {stop}) are {end - begin} bytes; got {len(frames)}")
    out = torch.empty(index.values(first, stop)[1] - first * index.chunk, dtype=torch.float32)
    offset = 0
    for c in range(first, stop):
        length = index.lengths[c]
        scales_np, q_np = _chunk_arrays(index, c, frames[offset:offset + length])
        offset += length
        begin_value = (c - first) * index.chunk
        per_value = torch.from_numpy(scales_np).repeat_interleave(index.block)[:q_np.size]
        values = torch.from_numpy(q_np).to(torch.float32) * per_value  # one fp32 multiply per value
        if not bool(torch.isfinite(values).all()):
            raise DeltaError("delta decodes to non-finite values (block scale too large)")
        out[begin_value:begin_value + q_np.size] = values
    return out


def _chunk_arrays(index: ChunkIndex, c: int, frame: bytes | memoryview) -> tuple[np.ndarray, np.ndarray]:
    """Chunk ``c``'s fp32 block scales and int8 values, checked."""
    count = min(index.chunk, index.numel - c * index.chunk)
    nblocks = -(-count // index.block)
    payload = _decompress_exact(bytes(frame), index._payload_size(c))
    return _arrays(payload, nblocks, count, index.bits)


def _arrays(payload: bytes, nblocks: int, numel: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    scales_np = np.frombuffer(payload, dtype="<f4", count=nblocks).astype(np.float32)
    if not np.isfinite(scales_np).all() or np.signbit(scales_np).any():
        raise DeltaError("delta has a negative or non-finite block scale")
    raw = np.frombuffer(payload, dtype=np.uint8, offset=4 * nblocks)
    return scales_np, (_unpack_int8(raw, numel) if bits == 8 else _unpack_nibbles(raw, numel, bits))


def _payload(data: bytes | bytearray | memoryview, like: OuterState) -> tuple[list[str], np.ndarray, np.ndarray, int]:
    """Check a delta's header and frame against ``like``; its sorted names, int8 values,
    fp32 block scales and block size."""
    data = bytes(data)
    names = sorted(like.params)
    expected_numel = sum(like.params[n].numel() for n in names)
    if data[:4] == MAGIC_CHUNKED:
        index = read_index(data, expected_numel)
        if len(data) != index.size:
            raise DeltaError(f"delta is {len(data)} bytes; its index says {index.size}")
        parts = [_chunk_arrays(index, c, data[slice(*index.span(c, c + 1))]) for c in range(index.nchunks)]
        del data
        return (names, np.concatenate([q for _s, q in parts]), np.concatenate([s for s, _q in parts]),
                index.block)
    if len(data) < _HEAD.size:
        raise DeltaError(f"delta is {len(data)} bytes, shorter than its {_HEAD.size}-byte header")
    magic, bits, block, numel = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise DeltaError("not a ttpeer delta (bad magic or unsupported version)")
    if bits not in ALLOWED_BITS or block not in ALLOWED_BLOCKS:
        raise DeltaError(f"delta uses bits={bits}, block={block}; not an allowed combination")
    if numel != expected_numel or numel == 0:
        raise DeltaError(f"delta has {numel} values; the model has {expected_numel}")
    nblocks = -(-numel // block)
    value_bytes = numel if bits == 8 else (numel + 1) // 2
    expected = 4 * nblocks + value_bytes
    payload = _decompress_exact(data[_HEAD.size:], expected)
    del data
    scales_np, q_np = _arrays(payload, nblocks, numel, bits)
    return names, q_np, scales_np, block


def fp32_size(state_or_delta: OuterState | dict[str, Tensor]) -> int:
    """Bytes of the tensors as raw fp32 (for an OuterState: its params only)."""
    tensors = state_or_delta.params if isinstance(state_or_delta, OuterState) else state_or_delta
    return sum(4 * t.numel() for t in tensors.values())


def _decompress_exact(frame: bytes, expected: int) -> bytes:
    if len(frame) > _frame_bound(expected):
        raise DeltaError(f"delta is {len(frame)} compressed bytes for a {expected}-byte payload")
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"delta payload is not a zstd frame: {exc}") from None
    # The declared size, when present, overrides max_output_size in python-zstandard,
    # so it must be checked first; our encoder always declares it.
    if declared != expected:
        raise DeltaError(f"delta frame declares {declared} bytes; expected exactly {expected}")
    try:
        payload = zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW).decompress(
            frame, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"delta payload does not decompress: {exc}") from None
    if len(payload) != expected:
        raise DeltaError(f"delta payload is {len(payload)} bytes; expected exactly {expected}")
    return payload


def _frame_bound(expected: int) -> int:
    # zstd's compress bound is size + size/256 + a few hundred bytes; anything
    # larger is not what a real encoder sends.
    return expected + (expected >> 7) + 1024


def _numel(shape: torch.Size) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _pad(flat: Tensor, block: int) -> Tensor:
    extra = -flat.numel() % block
    return torch.cat([flat, flat.new_zeros(extra)]) if extra else flat


def _dequantize(q: Tensor, scales: Tensor, block: int) -> Tensor:
    # One fp32 multiply per value: exactly rounded, so identical on every CPU.
    numel = q.numel()
    values = _pad(q.to(torch.float32), block).view(-1, block)
    return (values * scales[:, None]).reshape(-1)[:numel]


def _pack_nibbles(q: np.ndarray) -> bytes:
    nibbles = (q.astype(np.uint8) & 0x0F)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()


def _unpack_int8(raw: np.ndarray, numel: int) -> np.ndarray:
    q = raw[:numel].view(np.int8)
    if (q == -128).any():
        raise DeltaError("delta has an 8-bit value of -128; the range is [-127, 127]")
    return q.copy()


def _unpack_nibbles(raw: np.ndarray, numel: int, bits: int) -> np.ndarray:
    nibbles = np.empty(2 * raw.size, dtype=np.uint8)
    nibbles[0::2] = raw & 0x0F
    nibbles[1::2] = raw >> 4
    if nibbles.size > numel and nibbles[numel:].any():
        raise DeltaError("delta has a non-zero padding nibble")
    nibbles = nibbles[:numel]
    # Two's complement: nibbles 9..15 stand for -7..-1, so [-qmax, qmax] leaves out the
    # nibbles qmax+1 .. 15-qmax (8 at 4 bits; 4..12 at 3), found with one uint8 pass.
    qmax = (1 << (bits - 1)) - 1
    if ((nibbles - np.uint8(qmax + 1)) <= np.uint8(14 - 2 * qmax)).any():
        raise DeltaError(f"delta has a {bits}-bit value outside [-{qmax}, {qmax}]")
    # 8..15 less 16 wraps in uint8 to 248..255, which are -8..-1 read as int8: no wider copy.
    return np.where(nibbles >= 8, nibbles - np.uint8(16), nibbles).view(np.int8)
