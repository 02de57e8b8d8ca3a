"""The outer state every peer must hold bit-identically, its hash and its bytes.

``OuterState.params`` holds every floating-point entry of the model's
``state_dict()``: all parameters and also floating buffers (e.g. BatchNorm
running statistics), which are averaged across peers like parameters. Integer
buffers (e.g. ``num_batches_tracked``) are not shared; each peer keeps its own.
Everything is fp32, on the CPU, contiguous.

The byte format (``state_to_bytes``) is read from untrusted peers, so
``state_from_bytes`` trusts nothing: a fixed header, hard caps, exact lengths::

    b"TTCK" | u32 version=1 | u32 count
    count x ( u16 name_len | name (utf-8) | u8 dtype (1 = float32) | u8 ndim | ndim x u64 )
    params data, then momentum data, each in header order, float32 little-endian

Names are unique and sorted, so one state has exactly one encoding.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch import Tensor, nn

from ._adapters import fresh_adapters
from ._errors import CheckpointError
from ._spec import LoadedTask

MAGIC = b"TTCK"
VERSION = 1
MAX_TENSORS = 100_000
MAX_NAME_CHARS = 256
MAX_NDIM = 8
MAX_TOTAL_BYTES = 8 << 30  # params + momentum
_DTYPE_FLOAT32 = 1
_HEAD = struct.Struct("<4sII")
_ENTRY = struct.Struct("<H")
_DIMS = struct.Struct("<BB")


@dataclass
class OuterState:
    """Global model parameters and the outer optimizer's Nesterov momentum.

    Both dicts have the same keys and shapes, in the model's ``state_dict()``
    order; tensors are fp32, CPU, contiguous. Treat instances as values:
    functions here return new states rather than changing their inputs.
    """

    params: dict[str, Tensor]
    momentum: dict[str, Tensor]


def floating_state(model: nn.Module) -> dict[str, Tensor]:
    """Copy the floating-point entries of ``model.state_dict()`` to fp32 CPU."""
    return {
        name: tensor.detach().to(device="cpu", dtype=torch.float32, copy=True,
                                 memory_format=torch.contiguous_format)
        for name, tensor in model.state_dict().items()
        if tensor.is_floating_point()
    }


def init_state(task: LoadedTask, seed: int) -> OuterState:
    """Build the task's model with the CPU generator seeded by ``seed``.

    The global random state is restored afterwards. Peers with the same torch
    version get bit-identical states; compare ``state_hash`` to be sure.
    Raises whatever the task's ``model()`` raises.
    """
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        # Adapters over a frozen base: the state is the adapters, made without the base.
        model = task.spec.model() if task.spec.lora is None else fresh_adapters(task.spec.model)
    params = floating_state(model)
    return OuterState(params=params, momentum={k: torch.zeros_like(v) for k, v in params.items()})


def state_hash(state: OuterState) -> str:
    """Return ``"sha256:<hex>"`` over names, shapes, dtypes and little-endian bytes
    of params then momentum, each in sorted-name order.

    Raises ValueError if the state is not fp32 CPU with matching momentum.
    """
    _check_state(state)
    digest = hashlib.sha256(b"ttpeer-state-v1")
    for section, tensors in ((b"params", state.params), (b"momentum", state.momentum)):
        digest.update(b"\0" + section + b"\0")
        for name in sorted(tensors):
            tensor = tensors[name]
            encoded = name.encode()
            digest.update(struct.pack("<I", len(encoded)) + encoded + b"float32")
            digest.update(struct.pack(f"<I{tensor.ndim}Q", tensor.ndim, *tensor.shape))
            digest.update(le_bytes(tensor))
    return "sha256:" + digest.hexdigest()


def state_to_bytes(state: OuterState) -> bytes:
    """Serialize ``state`` in the format in this module's docstring.

    Raises ValueError if the state is not fp32 CPU with matching momentum, or
    breaks a cap (tensor count, name length, rank, 8 GiB total).
    """
    return b"".join(state_chunks(state))


def state_chunks(state: OuterState) -> list[bytes | memoryview]:
    """``state_to_bytes`` as a list of pieces to write one after the other: the
    tensors' pieces are views of their memory, so writing a state to a file needs no
    second copy of it. Raises as ``state_to_bytes``."""
    _check_state(state)
    names = sorted(state.params)
    if len(names) > MAX_TENSORS:
        raise ValueError(f"state has {len(names)} tensors; the format allows {MAX_TENSORS}")
    parts: list[bytes | memoryview] = [_HEAD.pack(MAGIC, VERSION, len(names))]
    total = 0
    for name in names:
        shape = tuple(state.params[name].shape)
        encoded = name.encode()
        if not 0 < len(name) <= MAX_NAME_CHARS or len(shape) > MAX_NDIM:
            raise ValueError(f"tensor {name!r} breaks the name-length or rank cap")
        parts += [_ENTRY.pack(len(encoded)), encoded, _DIMS.pack(_DTYPE_FLOAT32, len(shape)),
                  struct.pack(f"<{len(shape)}Q", *shape)]
        total += 2 * 4 * state.params[name].numel()
    if total > MAX_TOTAL_BYTES:
        raise ValueError(f"state is {total} bytes; the format allows {MAX_TOTAL_BYTES}")
    for tensors in (state.params, state.momentum):
        parts += [le_bytes(tensors[name]) for name in names]
    return parts


def state_from_bytes(data: bytes | bytearray | memoryview,
                     like: OuterState | None = None) -> OuterState:
    """Parse bytes written by ``state_to_bytes``; safe on hostile input.

    With ``like``, the tensor names and shapes must be exactly those of
    ``like`` and the result follows ``like``'s key order (``like`` may be a
    template on the meta device: only names and shapes are read). Raises
    CheckpointError for a wrong magic or version, a cap broken (tensor count,
    name length, rank, 8 GiB), a dtype other than float32, duplicate or
    unsorted names, a length that is not exact, or a mismatch with ``like``.
    """
    view = memoryview(data).cast("B")
    reader = _Reader(view)
    return _parse(reader, len(view), like, lambda shape: _read_tensor(reader, shape))


def state_from_file(path: Path, like: OuterState | None = None) -> OuterState:
    """``state_from_bytes`` of a file, read straight into the tensors: the file's bytes
    and the tensors are never in memory at once. Raises CheckpointError as
    ``state_from_bytes``, OSError if the file cannot be read."""
    with open(path, "rb") as f:
        reader = _FileReader(f)

        def tensor(shape: tuple[int, ...]) -> Tensor:
            out = torch.empty(shape, dtype=torch.float32)
            array = out.numpy().reshape(-1).view(np.uint8)
            if f.readinto(array.data) != array.size:
                raise CheckpointError("state checkpoint is truncated")
            if sys.byteorder != "little":
                out.numpy().byteswap(inplace=True)
            return out

        return _parse(reader, os.fstat(f.fileno()).st_size, like, tensor)


def file_state_hash(path: Path) -> str:
    """``state_hash`` of the state in the file at ``path``, read a MiB at a time: no
    tensor is made. The file holds the hashed bytes in the hashed order (sorted names,
    params then momentum, little-endian). Raises CheckpointError as ``state_from_file``,
    OSError if the file cannot be read."""
    with open(path, "rb") as f:
        reader = _FileReader(f)
        entries = _header(reader, os.fstat(f.fileno()).st_size)
        digest = hashlib.sha256(b"ttpeer-state-v1")
        for section in (b"params", b"momentum"):
            digest.update(b"\0" + section + b"\0")
            for name, shape in entries:
                encoded = name.encode()
                digest.update(struct.pack("<I", len(encoded)) + encoded + b"float32")
                digest.update(struct.pack(f"<I{len(shape)}Q", len(shape), *shape))
                left = 4 * _numel(shape)
                while left:
                    chunk = f.read(min(left, 1 << 20))
                    if not chunk:
                        raise CheckpointError("state checkpoint is truncated")
                    digest.update(chunk)
                    left -= len(chunk)
    return "sha256:" + digest.hexdigest()


def iter_state_file(path: Path, like: OuterState) -> Iterator[tuple[str, Tensor, Tensor]]:
    """The state in the file at ``path`` one tensor at a time, as ``(name, param,
    momentum)`` in ``like``'s order: a caller that uses each pair and drops it never
    holds the whole state. Checked as ``state_from_file`` (the header against ``like``,
    the exact length) before the first pair; its hash is not (``file_state_hash``)."""
    with open(path, "rb") as f:
        reader = _FileReader(f)
        entries = _header(reader, os.fstat(f.fileno()).st_size)
        _match(entries, like)
        where: dict[str, int] = {}
        offset = reader.offset
        for name, shape in entries:
            where[name] = offset
            offset += 4 * _numel(shape)
        half = offset - reader.offset  # the momentum section follows the params section

        def tensor(shape: tuple[int, ...], at: int) -> Tensor:
            out = torch.empty(shape, dtype=torch.float32)
            array = out.numpy().reshape(-1).view(np.uint8)
            f.seek(at)
            if f.readinto(array.data) != array.size:
                raise CheckpointError("state checkpoint is truncated")
            if sys.byteorder != "little":
                out.numpy().byteswap(inplace=True)
            return out

        shapes = dict(entries)
        for name in like.params:
            yield name, tensor(shapes[name], where[name]), tensor(shapes[name], where[name] + half)


def _header(reader: _Reader | _FileReader, size: int) -> list[tuple[str, tuple[int, ...]]]:
    """The checked header's names and shapes; the body must be exactly their size."""
    magic, version, count = _HEAD.unpack(reader.take(_HEAD.size))
    if magic != MAGIC:
        raise CheckpointError("not a ttpeer state checkpoint (bad magic)")
    if version != VERSION:
        raise CheckpointError(f"state checkpoint version {version} is not supported "
                              f"(this build reads {VERSION})")
    if count > MAX_TENSORS:
        raise CheckpointError(f"state checkpoint claims {count} tensors; cap is {MAX_TENSORS}")
    entries: list[tuple[str, tuple[int, ...]]] = []
    total = 0
    for _ in range(count):
        name, shape = _read_entry(reader)
        if entries and name <= entries[-1][0]:
            raise CheckpointError(f"state checkpoint names are unsorted or repeated at {name!r}")
        total += 2 * 4 * _numel(shape)
        if total > MAX_TOTAL_BYTES:
            raise CheckpointError(f"state checkpoint is larger than {MAX_TOTAL_BYTES} bytes")
        entries.append((name, shape))
    if size - reader.offset != total:
        raise CheckpointError(f"state checkpoint body is {size - reader.offset} bytes; "
                              f"its header says {total}")
    return entries


def _parse(reader: _Reader | _FileReader, size: int, like: OuterState | None,
           read_tensor: Callable[[tuple[int, ...]], Tensor]) -> OuterState:
    entries = _header(reader, size)
    if like is not None:
        _match(entries, like)
    params: dict[str, Tensor] = {}
    momentum: dict[str, Tensor] = {}
    for tensors in (params, momentum):
        for name, shape in entries:
            tensors[name] = read_tensor(shape)
    if like is not None:
        params = {name: params[name] for name in like.params}
        momentum = {name: momentum[name] for name in like.params}
    return OuterState(params=params, momentum=momentum)


def template(state: OuterState) -> OuterState:
    """``state``'s names and shapes on the meta device: what ``state_from_bytes`` and
    ``decode_delta`` check against, in no memory at all."""
    return OuterState(params={n: torch.empty(t.shape, device="meta") for n, t in state.params.items()},
                      momentum={n: torch.empty(t.shape, device="meta") for n, t in state.momentum.items()})


class _FileReader:
    """``_Reader`` over an open file: the header is read piece by piece."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.offset = f, 0

    def take(self, size: int) -> memoryview:
        chunk = self.f.read(size)
        if len(chunk) != size:
            raise CheckpointError("state checkpoint is truncated")
        self.offset += size
        return memoryview(chunk)


class _Reader:
    """Bounds-checked cursor: reading past the end is a CheckpointError."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.offset = view, 0

    def take(self, size: int) -> memoryview:
        if self.offset + size > len(self.view):
            raise CheckpointError("state checkpoint is truncated")
        chunk = self.view[self.offset:self.offset + size]
        self.offset += size
        return chunk


def _read_entry(reader: _Reader | _FileReader) -> tuple[str, tuple[int, ...]]:
    (name_len,) = _ENTRY.unpack(reader.take(_ENTRY.size))
    if not 0 < name_len <= 4 * MAX_NAME_CHARS:
        raise CheckpointError(f"state checkpoint has a tensor name of {name_len} bytes")
    try:
        name = bytes(reader.take(name_len)).decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError("state checkpoint has a tensor name that is not utf-8") from None
    if len(name) > MAX_NAME_CHARS:
        raise CheckpointError(f"state checkpoint tensor name is over {MAX_NAME_CHARS} chars")
    dtype, ndim = _DIMS.unpack(reader.take(_DIMS.size))
    if dtype != _DTYPE_FLOAT32:
        raise CheckpointError(f"state checkpoint tensor {name!r} has dtype code {dtype}; "
                              "only float32 is allowed")
    if ndim > MAX_NDIM:
        raise CheckpointError(f"state checkpoint tensor {name!r} has rank {ndim} > {MAX_NDIM}")
    shape = struct.unpack(f"<{ndim}Q", reader.take(8 * ndim))
    return name, shape


def _read_tensor(reader: _Reader, shape: tuple[int, ...]) -> Tensor:
    count = _numel(shape)
    chunk = reader.take(4 * count)
    array = np.frombuffer(chunk, dtype="<f4", count=count).astype(np.float32, copy=True)
    return torch.from_numpy(array).reshape(shape)


def _match(entries: list[tuple[str, tuple[int, ...]]], like: OuterState) -> None:
    got = dict(entries)
    want = {name: tuple(t.shape) for name, t in like.params.items()}
    if got.keys() != want.keys():
        missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        raise CheckpointError(f"state checkpoint does not match the model: missing "
                              f"{missing[:5]}, unexpected {extra[:5]}")
    for name, shape in want.items():
        if got[name] != shape:
            raise CheckpointError(f"state checkpoint tensor {name!r} has shape {got[name]}, "
                                  f"the model has {shape}")


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _check_state(state: OuterState) -> None:
    if state.params.keys() != state.momentum.keys():
        raise ValueError("params and momentum must have the same names")
    for name, tensor in _all_tensors(state):
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            raise ValueError(f"tensor {name!r} must be float32 on the CPU")
        if tensor.shape != state.params[name].shape:
            raise ValueError(f"momentum {name!r} has a different shape than its parameter")


def _all_tensors(state: OuterState) -> Iterator[tuple[str, Tensor]]:
    yield from state.params.items()
    yield from state.momentum.items()


def le_bytes(tensor: Tensor) -> memoryview:
    # numpy views the tensor's memory; the astype only copies on big-endian hosts.
    array = tensor.detach().contiguous().numpy().astype("<f4", copy=False)
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
