"""Exporting the trained model: a deterministic safetensors file plus a JSON
sidecar with its provenance.

The file is written here rather than by ``safetensors.torch.save``, whose
header puts metadata keys in a random order: the same parameters must give the
same bytes, and so the same sha256, on every peer. The layout is the
safetensors one (u64 header length, JSON header padded with spaces to 8 bytes,
raw little-endian data), with keys sorted, so any safetensors reader loads it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from torch import nn

from ._atomic import write_atomic
from ._errors import CheckpointError
from ._spec import LoadedTask
from ._state import OuterState, le_bytes, state_hash


def export_model(state: OuterState, task: LoadedTask, out: Path, metrics: dict[str, Any]) -> str:
    """Write ``state.params`` to ``out`` and a ``.json`` sidecar; return the
    model file's sha256 hex digest.

    Both files are written atomically. The sidecar holds ``metrics``, the task
    name and source hash, the task's ``info`` (if any), the parameter count and the state hash. Raises
    ValueError if the state is not fp32 CPU, TypeError or ValueError if
    ``metrics`` is not JSON-serializable, and OSError if ``out`` is not writable.
    """
    out = Path(out)
    # Pieces, the tensors' as views of their memory: hashed and written without a copy.
    pieces = _safetensors_chunks(state, {"ttpeer": "1", "task": task.name})
    hasher = hashlib.sha256()
    for piece in pieces:
        hasher.update(piece)
    digest = hasher.hexdigest()
    sidecar = {
        "mode": "fused",
        "task": task.name,
        "source_hash": task.source_hash,
        "param_count": sum(t.numel() for t in state.params.values()),
        "state_hash": state_hash(state),
        "model_file": out.name,
        "model_sha256": digest,
        "metrics": metrics,
    }
    if task.own_hash and task.own_hash != task.source_hash:  # the task file's own sha256 (ttpeer.load finds it by)
        sidecar["task_sha256"] = task.own_hash
    if task.spec.info:
        sidecar["task_info"] = dict(task.spec.info)
    text = json.dumps(sidecar, indent=2, sort_keys=True) + "\n"
    write_atomic(out, pieces)
    write_atomic(out.with_suffix(".json"), text.encode())
    return digest


def load_model(path: Path, task: LoadedTask) -> nn.Module:
    """Build ``task.spec.model()``, load the parameters exported to ``path``, and
    return it in eval mode.

    Raises CheckpointError if the file is not a ttpeer safetensors export or
    its tensor names or shapes do not match the model; OSError if unreadable.
    """
    data = Path(path).read_bytes()
    try:
        tensors = safetensors_load(data)
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a safetensors file: {exc}") from exc
    model = task.spec.model()
    expected = {n: t.shape for n, t in model.state_dict().items() if t.is_floating_point()}
    if tensors.keys() != expected.keys():
        raise CheckpointError(f"{path} does not match task {task.name}: missing "
                              f"{sorted(expected.keys() - tensors.keys())[:5]}, unexpected "
                              f"{sorted(tensors.keys() - expected.keys())[:5]}")
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise CheckpointError(f"{path}: tensor {name!r} has shape "
                                  f"{tuple(tensors[name].shape)}, the model has {tuple(shape)}")
    # strict=False: integer buffers are not exported and keep their fresh values.
    model.load_state_dict(tensors, strict=False)
    return model.eval()


def _safetensors_bytes(state: OuterState, metadata: dict[str, str]) -> bytes:
    return b"".join(_safetensors_chunks(state, metadata))


def _safetensors_chunks(state: OuterState, metadata: dict[str, str]) -> list[bytes | memoryview]:
    names = sorted(state.params)
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name in names:
        tensor = state.params[name]
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            raise ValueError(f"tensor {name!r} must be float32 on the CPU")
        size = 4 * tensor.numel()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return [struct.pack("<Q", len(encoded)) + encoded, *(le_bytes(state.params[name]) for name in names)]
