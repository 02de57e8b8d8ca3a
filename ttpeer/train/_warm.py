"""Warm starts: a job's initial state from a safetensors file instead of a fresh model.

The file is an export of this project (``ttpeer export``, or a finished job's
``final.safetensors``) or any state dict saved with safetensors whose tensors match
the task's model; for a LoRA task, also a peft adapter file (``adapter_model.safetensors``,
as ``export --format peft`` or any peft ``save_pretrained`` writes it). The result is an
``OuterState`` like ``init_state``'s (fp32, zero outer momentum), so nothing downstream
knows the difference: the submitter seals it as the job's ``init_blob`` and every peer
starts from its hash.

Checks, in the model's own ``state_dict()`` order, each naming the first offending
tensor: every floating tensor of the model is in the file, with its shape; no
floating tensor in the file is one the model lacks; each dtype is the model's, or a
narrower float (fp16, bf16) that widens to it exactly. The model's integer buffers
(e.g. ``num_batches_tracked``) are not shared state and are ignored either way.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ._errors import CheckpointError
from ._spec import LoadedTask
from ._state import OuterState
from ._tasks import check_model

_WIDENS_EXACTLY = {torch.float32: {torch.float16, torch.bfloat16}, torch.float64: {torch.float32, torch.float16,
                                                                                 torch.bfloat16}}


def warm_state(task: LoadedTask, path: Path) -> OuterState:
    """The outer state of a job that starts from the weights in ``path``.

    Raises CheckpointError when the file cannot be read, is not safetensors, or its
    tensors do not match the task's model (the message names the first tensor that
    does not), and TaskError if the task's model cannot be built.
    """
    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        raise CheckpointError(f"--init {path}: no such file (give a .safetensors file or a finished "
                              "job's id)") from None
    except OSError as exc:
        raise CheckpointError(f"--init {path}: cannot read it: {exc.strerror or exc}") from None
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(f"--init {path} is not a safetensors file: {exc}") from None
    model = check_model(task.spec, f"task {task.name}")
    everything = model.state_dict()
    expected = {n: t for n, t in everything.items() if t.is_floating_point()}
    if task.spec.lora is not None and not expected.keys() & tensors.keys():
        tensors = _adapter_names(tensors)
    where = f"--init {path.name} does not match task {task.name}'s model"
    for name, want in expected.items():
        got = tensors.get(name)
        if got is None:
            raise CheckpointError(f"{where}: it has no tensor {name!r} (the model has {len(expected)} "
                                  "floating tensors; is it an export of another model?)")
        if got.shape != want.shape:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(got.shape)}, the model's "
                                  f"is {tuple(want.shape)}")
        if got.dtype != want.dtype and got.dtype not in _WIDENS_EXACTLY.get(want.dtype, set()):
            raise CheckpointError(f"{where}: tensor {name!r} is {_dtype(got.dtype)}, the model's is "
                                  f"{_dtype(want.dtype)}; convert the file to {_dtype(want.dtype)}")
    extra = next((n for n, t in tensors.items() if n not in everything and t.is_floating_point()), None)
    if extra is not None:
        raise CheckpointError(f"{where}: it has a tensor {extra!r} that the model does not have")
    params = {name: tensors[name].to(torch.float32).contiguous() for name in expected}
    return OuterState(params=params, momentum={k: torch.zeros_like(v) for k, v in params.items()})


def _adapter_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A peft adapter file's tensors under the names a LoRA task's state gives them: peft
    saves ``...q_proj.lora_A.weight``, the live model (one adapter, ``default``) holds
    ``...q_proj.lora_A.default.weight``."""
    renamed = {}
    for name, tensor in tensors.items():
        for part in (".lora_A.", ".lora_B."):
            if part in name and f"{part}default." not in name:
                name = name.replace(part, f"{part}default.")
        renamed[name] = tensor
    return renamed


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
