"""``ttpeer demo`` as a user runs it (a short one: ``--rounds 1``, about 20 s on 2 cores):
a relay and 4 daemons as processes, three jobs, and a report that fits 80 columns, whose
times are the ones its progress lines showed and fit inside the run's own wall time."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from ttpeer.demo import NEXT_STEPS

LABELS = ("one peer alone", "fused pool, 3 peers", "ensemble, 3 members")


def test_the_demo_prints_paced_runs_their_times_and_the_next_steps():
    began = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "ttpeer", "demo", "--rounds", "1"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"}, timeout=240)
    took = time.monotonic() - began
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80, out  # even on a wider terminal
    assert "80 steps a peer, each paced to 20 ms as if on a GPU" in out
    assert "each paced step stands for a GPU's" in " ".join(lines)
    assert lines[-len(NEXT_STEPS):] == [line.rstrip() for line in NEXT_STEPS]
    assert "Bit-identical on the 3 peers: the fused model" in out
    target = re.search(r"time to (\d\.\d{3})", out)
    assert target, out
    walls = []
    for label in LABELS:
        bar = next(line for line in lines if line.startswith(label))
        row = re.search(rf"│ {re.escape(label)} +│ +(\d\.\d{{3}}) │ +(not reached|[\d.]+ s) │ +([\d.]+) s │", out)
        assert row, out
        accuracy, reached, wall = row.groups()
        assert re.search(rf"acc {accuracy} +{wall} s$", bar), (bar, row.group(0))
        if reached != "not reached":
            assert float(reached.removesuffix(" s")) <= float(wall)
        walls.append(float(wall))
    assert target.group(1) == re.search(r"│ one peer alone +│ +(\d\.\d{3})", out).group(1)
    assert sum(walls) < took  # the jobs ran one after the other, inside the demo's own time
