"""Mixed precision for the inner loop: autocast over forward and backward, nothing else.

The model's weights (the master copy), its gradients, AdamW and its moments, the
pseudo-gradient, the outer step and every hash stay fp32. Only the matmuls and
convolutions of the forward pass (and so the backward pass autograd derives from
it) run in bf16 or fp16 under ``torch.autocast``. A pool of different hardware,
some peers in bf16 and some in fp32, therefore still ends every round with the
bit-identical fp32 model: the close is computed from the published fp32 deltas.

fp16 has a narrow exponent range: its gradients go through a ``GradScaler``
(loss scaled up before backward, gradients unscaled before clipping, steps with
inf/NaN gradients skipped and the scale lowered). bf16 has fp32's range and needs none.

A job may leave its precision out ("auto"): each peer then picks bf16 where its
device runs it fast (a CUDA GPU with bf16, compute capability 8.0 and up) and fp32
elsewhere. On the CPU autocast works but is slower: measured on this project's
shared 2-core x86 machine (torch 2.13, 1 thread, ``scripts/bench/precision``), bf16
ran at 0.26x the fp32 steps/s on the mnist1d MLP and 0.11x on the default charlm; so
"auto" is fp32 on the CPU.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

PRECISIONS = ("fp32", "bf16", "fp16")
AUTO = "auto"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def supported(precision: str, device: torch.device) -> bool:
    """Can ``device`` autocast to ``precision``?"""
    if precision == "fp32":
        return True
    if device.type == "cuda":
        return precision == "fp16" or _native_bf16(device)
    if device.type == "cpu":
        return True  # both are CPU autocast dtypes since torch 2.x
    with warnings.catch_warnings(record=True) as caught:  # torch warns and disables when unsupported
        warnings.simplefilter("always")
        with torch.autocast(device.type, dtype=_DTYPES[precision]):
            pass
    return not caught


def _native_bf16(device: torch.device) -> bool:
    try:  # without emulation: a GPU that emulates bf16 (before compute capability 8.0) is slow at it
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch < 2.4 has no such argument, and counts only native support
        return torch.cuda.is_bf16_supported()


def resolve(requested: str, device: torch.device) -> str:
    """The precision this peer trains with: ``requested``, or for "auto" bf16 on a CUDA
    device with bf16 and fp32 elsewhere. Raises ValueError (a sentence for the decline)
    when ``requested`` is one this device cannot run."""
    if requested == AUTO:
        return "bf16" if device.type == "cuda" and supported("bf16", device) else "fp32"
    if requested not in PRECISIONS:
        raise ValueError(f"unknown precision {requested!r}: use one of {', '.join(PRECISIONS)}")
    if not supported(requested, device):
        others = [p for p in PRECISIONS if p != requested and supported(p, device)]
        raise ValueError(f"this peer's device {device} cannot autocast to {requested}; submit the job with "
                         f"--precision {' or '.join(others)}, or leave --precision out (each peer then "
                         "picks what it runs best)")
    return requested


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The context the forward pass (and its loss) runs in."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_DTYPES[precision])


def scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A gradient scaler for fp16, None otherwise."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None

