"""Real processes on loopback: a relay over real TLS and three `ttpeer` daemons.

One peer is SIGKILLed while it trains a shard; its lease expires, the survivors
take the shard over, finish the job, and export bit-identical models (I2, I3, I4).
"""

from __future__ import annotations

import os
import signal

import pytest

from ttpeer.daemon import call
from ttpeer.demo import Cluster, job_spec, make_pool, status, ttpeer, wait_for

pytestmark = pytest.mark.slow


def _job(home, job_id):
    return next((j for j in status(home)["jobs"] if j["id"] == job_id), None)


def test_sigkill_mid_round_survivors_finish_identically(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        # Slowed batches make a shard take long enough to catch carol in the middle of one.
        homes = make_pool(cluster, url, fp, ["alice", "bob", "carol"], extra=("--slowdown", "4"))
        spec = {**job_spec(rounds=4), "lease": 3.0, "batches": 60}
        job = call(homes[0] / "control.sock", {"op": "submit", "spec": spec, "task_file": None},
                   timeout=120)["job"]

        # Wait until carol is training a shard of round >= 1, then kill her outright.
        def carol_busy():
            j = _job(homes[2], job)
            return j is not None and j["round"] >= 1 and j["training_shard"] is not None

        wait_for(carol_busy, 120, "carol to be training a shard", poll=0.02)
        killed_round = _job(homes[0], job)["round"]
        os.killpg(cluster.named["carol"].pid, signal.SIGKILL)
        cluster.named["carol"].wait(timeout=10)

        def survivors_done():
            return all((j := _job(h, job)) is not None and j["state"] == "done" for h in homes[:2])

        wait_for(survivors_done, 240, "the survivors to finish the job", poll=0.25)
        hashes = [ttpeer("export", job, str(h / "out.safetensors"), "--home", str(h))[-1] for h in homes[:2]]
        assert hashes[0] == hashes[1] and len(hashes[0]) == 64
        final = _job(homes[0], job)
        assert final["round"] == spec["rounds"] > killed_round
        assert final["eval_metric"] > 0.3  # it trained: mnist1d starts near 0.1
    finally:
        cluster.close()
    assert all(p.poll() is not None for p in cluster.procs)
