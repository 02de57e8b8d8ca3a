"""Data parallelism inside one machine: a peer's workers train each shard together.

A peer with several local devices runs one worker process per device, joined in a
``torch.distributed`` process group (NCCL on CUDA, gloo on CPU). Each worker holds
the whole model; every batch of the job is split between them by position (rank r
takes items r, r + W, ...), each computes the gradient of its part, and the
gradients are averaged across the group as they accumulate (a hook per parameter),
before clipping and the AdamW step. Every worker then takes the same step, so the
local copies stay identical and any one of them is the peer's local model. The
job's batch (its meaning) is unchanged; with a batch that W does not divide, the
parts differ by one item and are weighted equally: close to, not exactly, the full
batch's mean gradient.

Stopping is agreed too: before each batch the workers take the maximum of their
stop flags, so all of them stop at the same batch (one stopping alone would leave
the others waiting in the next all-reduce). So is an overlapped round's correction
onto a close that landed (``daemon/worker/_overlap.py``): only the first worker closes rounds,
and the state it names reaches every worker at the same batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def join_group(store: Path, rank: int, world: int, device: str) -> None:
    """Join this worker's process group (blocks until all ``world`` have joined)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, store=dist.FileStore(str(store), world), rank=rank, world_size=world)


def split(batches: Sequence[Sequence[int]], rank: int, world: int) -> list[list[int]]:
    return [list(batch[rank::world]) for batch in batches]


def average_gradients(model: nn.Module, world: int) -> None:
    """Average every parameter's gradient across the group as it accumulates."""

    def hook(param: torch.Tensor) -> None:
        assert param.grad is not None
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad.div_(world)

    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(hook)


def agreed(should_stop: Callable[[], bool], device: str) -> Callable[[], bool]:
    """``should_stop`` decided for the whole group: any worker's True stops them all."""

    def ask() -> bool:
        flag = torch.tensor([1 if should_stop() else 0], device=torch.device(device))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    return ask


def agreed_signal(device: str) -> Callable[[bool, str | None], tuple[bool, str | None]]:
    """``(stop, state)`` decided for the whole group: any worker's stop stops them all,
    and a state hash (``sha256:...``) that one worker names reaches all of them."""
    dev = torch.device(device)

    def ask(stop: bool, state: str | None) -> tuple[bool, str | None]:
        raw = bytes.fromhex(state.removeprefix("sha256:")) if state else bytes(32)
        flags = torch.tensor([1 if stop else 0, 1 if state else 0, *raw], dtype=torch.int32, device=dev)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        got = flags.tolist()
        return bool(got[0]), ("sha256:" + bytes(got[2:]).hex()) if got[1] else None

    return ask
