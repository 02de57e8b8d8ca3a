"""Compressed pseudo-gradients: blockwise absmax quantization + zstd, with error
feedback.

A delta is flattened (tensors in sorted-name order) into one fp32 vector, cut
into blocks of ``block`` values; each block stores one fp32 scale (absmax /
qmax) and one signed integer per value, 8-bit in [-127, 127] or 4-bit in [-7, 7]
(two's-complement nibbles, low nibble first, a zero nibble pads an odd count).
What quantization drops is returned as a residual, to be added to the next
round's delta, so the error does not accumulate (error feedback).

Wire format (header then one zstd frame)::

    b"TTD1" | u8 bits | u32 block | u64 numel | zstd( scales <f4 x nblocks | values )

Bytes come from other peers, so ``decode_delta`` checks every field against the
local model before decompressing, and decompresses into exactly the size the
header implies: a frame that claims or produces more is refused. Decoding uses
only fp32 multiplies on the CPU, so the same bytes give bit-identical tensors
on every machine.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np
import torch
import zstandard
from torch import Tensor

from ._errors import DeltaError, Diverged
from ._state import OuterState

MAGIC = b"TTD1"
ALLOWED_BITS = frozenset({4, 8})
ALLOWED_BLOCKS = frozenset(1 << k for k in range(4, 17))  # 16 .. 65536
_HEAD = struct.Struct("<4sBIQ")
_MAX_WINDOW = 1 << 27  # zstd's own default limit, stated so it cannot drift
_CHUNK_VALUES = 1 << 20  # values quantized at a time: temporaries of a few MB, not of the model


def encode_delta(delta: dict[str, Tensor], residual: dict[str, Tensor] | None, *,
                 bits: int = 8, block: int = 256,
                 level: int = 3) -> tuple[bytes, dict[str, Tensor]]:
    """Quantize and compress ``delta + residual``; return the bytes and the new
    residual (input minus what the receiver will decode), fp32 CPU.

    Raises Diverged if the input holds NaN or inf (local training diverged),
    ValueError for bits/block/level outside the allowed values, an empty delta,
    or a residual whose names or shapes differ from the delta's.
    """
    if bits not in ALLOWED_BITS or block not in ALLOWED_BLOCKS:
        raise ValueError(f"bits must be in {sorted(ALLOWED_BITS)} and block a power of two "
                         f"in [16, 65536], got bits={bits}, block={block}")
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
    chunk = block * max(1, _CHUNK_VALUES // block)
    for begin in range(0, numel, chunk):
        end = min(begin + chunk, numel)
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

    values = q.numpy().tobytes() if bits == 8 else _pack_nibbles(q.numpy())
    del q
    payload = scales.numpy().astype("<f4").tobytes() + values
    del values
    frame = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(payload)
    return _HEAD.pack(MAGIC, bits, block, numel) + frame, new_residual


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


def _payload(data: bytes | bytearray | memoryview, like: OuterState) -> tuple[list[str], np.ndarray, np.ndarray, int]:
    """Check a delta's header and frame against ``like``; its sorted names, int8 values,
    fp32 block scales and block size."""
    data = bytes(data)
    if len(data) < _HEAD.size:
        raise DeltaError(f"delta is {len(data)} bytes, shorter than its {_HEAD.size}-byte header")
    magic, bits, block, numel = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise DeltaError("not a ttpeer delta (bad magic or unsupported version)")
    if bits not in ALLOWED_BITS or block not in ALLOWED_BLOCKS:
        raise DeltaError(f"delta uses bits={bits}, block={block}; not an allowed combination")
    names = sorted(like.params)
    expected_numel = sum(like.params[n].numel() for n in names)
    if numel != expected_numel or numel == 0:
        raise DeltaError(f"delta has {numel} values; the model has {expected_numel}")
    nblocks = -(-numel // block)
    value_bytes = numel if bits == 8 else (numel + 1) // 2
    expected = 4 * nblocks + value_bytes
    payload = _decompress_exact(data[_HEAD.size:], expected)
    del data

    scales_np = np.frombuffer(payload, dtype="<f4", count=nblocks).astype(np.float32)
    if not np.isfinite(scales_np).all() or np.signbit(scales_np).any():
        raise DeltaError("delta has a negative or non-finite block scale")
    raw = np.frombuffer(payload, dtype=np.uint8, offset=4 * nblocks)
    q_np = _unpack_int8(raw, numel) if bits == 8 else _unpack_nibbles(raw, numel)
    return names, q_np, scales_np, block


def fp32_size(state_or_delta: OuterState | dict[str, Tensor]) -> int:
    """Bytes of the tensors as raw fp32 (for an OuterState: its params only)."""
    tensors = state_or_delta.params if isinstance(state_or_delta, OuterState) else state_or_delta
    return sum(4 * t.numel() for t in tensors.values())


def _decompress_exact(frame: bytes, expected: int) -> bytes:
    # zstd's compress bound is size + size/256 + a few hundred bytes; anything
    # larger is not what a real encoder sends.
    if len(frame) > expected + (expected >> 7) + 1024:
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


def _unpack_nibbles(raw: np.ndarray, numel: int) -> np.ndarray:
    nibbles = np.empty(2 * raw.size, dtype=np.uint8)
    nibbles[0::2] = raw & 0x0F
    nibbles[1::2] = raw >> 4
    if nibbles.size > numel and nibbles[numel:].any():
        raise DeltaError("delta has a non-zero padding nibble")
    nibbles = nibbles[:numel]
    if (nibbles == 8).any():
        raise DeltaError("delta has a 4-bit value of -8; the range is [-7, 7]")
    # Two's complement: nibbles 9..15 stand for -7..-1.
    return np.where(nibbles >= 8, nibbles.astype(np.int16) - 16, nibbles).astype(np.int8)
