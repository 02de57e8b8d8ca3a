"""The daemon's start-up warm-up covers what a job's first memory estimate would load.

Without it, the first ``memory_need`` of a process imports torch's meta-device
decompositions (hundreds of modules, about a second) on the job's critical path.
Run in a fresh interpreter: the test process has long since imported them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # it starts a process

TASK = """
import torch
from torch import nn
import torch.nn.functional as F
from ttpeer.train import TaskSpec

def task():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 40, generator=g), torch.randint(0, 10, (64,), generator=g)
    return TaskSpec(model=lambda: nn.Sequential(nn.Linear(40, 32), nn.ReLU(), nn.Linear(32, 10)),
                    train=(x, y), test=(x, y), loss=F.cross_entropy,
                    metric=lambda out, t: (out.argmax(-1) == t).float().mean().item())
"""

PROBE = """
import sys
from pathlib import Path
from ttpeer import train

task = train.load_task(sys.argv[1], Path(sys.argv[2]))
if sys.argv[3] == "warm":
    train.warm_up()
before = set(sys.modules)
need = train.memory_need(task, batch_size=64, shards=2)
assert need.activations > 0, need
print(len(set(sys.modules) - before))
"""


def _new_modules(tmp_path: Path, mode: str) -> int:
    task = tmp_path / "tiny.py"
    task.write_text(TASK)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE), str(task), str(tmp_path), mode],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().splitlines()[-1])


def test_after_the_warm_up_a_first_memory_estimate_imports_nothing(tmp_path: Path) -> None:
    cold = _new_modules(tmp_path, "cold")
    assert cold > 50, f"a cold memory_need imported only {cold} modules: nothing left to warm up?"
    assert _new_modules(tmp_path, "warm") == 0
