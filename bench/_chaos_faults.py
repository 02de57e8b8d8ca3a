"""What the campaign's faults do, one primitive each: fill a disk, corrupt a relay's blob,
find a daemon's workers, and the task file that is broken on purpose."""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path

BAD_TASK = '''
import torch
import torch.nn.functional as F
from torch import nn
from ttpeer.train import TaskSpec

CALLS = 0

def _data(count, seed):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (count,), generator=gen)
    return torch.randn(count, 8, generator=gen) + y[:, None].float(), y

def loss(output, target):
    global CALLS
    CALLS += 1
    if CALLS > 3:  # the probe at submit passes; training raises
        raise RuntimeError("chaos: this task is broken on purpose")
    return F.cross_entropy(output, target)

def task():
    return TaskSpec(model=lambda: nn.Linear(8, 4), train=_data(256, 1), test=_data(64, 2), loss=loss,
                    metric=lambda o, t: (o.argmax(-1) == t).float().mean().item(), batch_size=16)
'''


def workers_of(pid: int) -> list[int]:
    """The worker processes a daemon started (its children), from /proc."""
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(k) for k in f.read().split()]
    return kids


def fill(home: Path) -> int:
    """Write zeros to ``home/chaos-fill`` until the disk is full; the bytes written."""
    written = 0
    chunk = bytes(1 << 20)
    with open(home / "chaos-fill", "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(chunk)
            except OSError:
                break
    return written


def corrupt(relay_data: Path, rng: random.Random) -> str | None:
    """Flip 16 bytes in the middle of one blob on a relay's disk (its mtime kept); its name."""
    blobs = sorted(p for p in relay_data.glob("pools/*/blobs/*") if "." not in p.name and p.stat().st_size > 64)
    if not blobs:
        return None
    path = rng.choice(blobs)
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        data = f.read(16)
        f.seek(st.st_size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return path.name[:12]
