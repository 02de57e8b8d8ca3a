"""Ensemble mode with real processes on loopback: a relay over real TLS and two
``ttpeer`` daemons. The job is submitted with the command line; one peer is
SIGKILLed while it trains a member; the survivor continues that member from its
last checkpoint and finishes; the exported bundle loads with ``ttpeer.load`` and
``ttpeer predict`` prints its votes."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch

import ttpeer
from ttpeer_harness import Cluster, make_pool, wait_for
from ttpeer_harness import ttpeer as run_ttpeer

from ._helpers import job_of

pytestmark = pytest.mark.slow
ROUNDS, STEPS = 3, 60


def test_sigkilled_member_continues_on_the_survivor_and_the_bundle_votes(tmp_path, monkeypatch):
    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        # Slowed batches make a unit long enough to catch bob in the middle of one.
        homes = make_pool(cluster, url, fp, ["alice", "bob"], extra=("--slowdown", "4"))
        lines = run_ttpeer("submit", "--task", "mnist1d", "--mode", "ensemble", "--members", "2",
                           "--rounds", str(ROUNDS), "--inner-steps", str(STEPS), "--lease", "3s",
                           "--home", str(homes[0]))
        job = lines[-1]
        assert "2 members" in lines[0]

        def bob_busy():
            j = job_of(homes[1], job)
            return j is not None and j["round"] >= 1 and j["training_shard"] is not None

        wait_for(bob_busy, 120, "bob to be training a member", poll=0.02)
        os.killpg(cluster.named["bob"].pid, signal.SIGKILL)
        cluster.named["bob"].wait(timeout=10)
        wait_for(lambda: (homes[0] / "states" / job / "done.json").exists(), 240, "alice to finish the job")

        out = tmp_path / "ensemble.safetensors"
        run_ttpeer("export", job, str(out), "--home", str(homes[0]))
        side = json.loads(out.with_suffix(".json").read_text())
        # Every member ends with all its steps: the requeued unit did not start the member over.
        assert [m["steps"] for m in side["members"]] == [ROUNDS * STEPS] * 2
        assert len({(m["seed"], m["lr"]) for m in side["members"]}) == 2
        assert side["ensemble"]["accuracy"] > 0.3  # it trained: mnist1d starts near 0.1

        model = ttpeer.load(out, data_dir=homes[0] / "data")
        rows = np.load(homes[0] / "data" / "mnist1d.npz")["x_test"][:8]
        with torch.no_grad():
            votes = model(torch.from_numpy(rows)).argmax(-1).tolist()
        np.save(tmp_path / "rows.npy", rows)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # predict caches mnist1d there
        printed = run_ttpeer("predict", str(out), str(tmp_path / "rows.npy"))
        assert [int(line.split("\t")[0]) for line in printed] == votes
    finally:
        cluster.close()
    assert all(p.poll() is not None for p in cluster.procs)
