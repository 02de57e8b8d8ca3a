"""``scripts/bench/workers`` (also ``scripts/gpu-check``'s first step) drives real executors
through a round: a short run of it ends with its figures, so a change to the executors'
interface that the script missed fails here rather than on the GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_workers_bench_runs_a_short_round_end_to_end():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "_workers.py"), "--task", "charlm", "--batches", "2",
         "--batch-size", "4", "--runs", "1", "--rounds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "worker process" in out.stdout and "target worker / bare >= 0.97:" in out.stdout
