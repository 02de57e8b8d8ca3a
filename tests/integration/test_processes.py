"""Real processes on loopback: a relay over real TLS and three `ttpeer` daemons.

Peers are SIGKILLed and SIGSTOPped while they train a shard; their leases expire,
the others take the shards over; the stopped peer resumes, the killed one restarts
with `ttpeer up`, and all of them export bit-identical models (I2, I3, I4).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ttpeer.daemon import call
from ttpeer_harness import Cluster, job_spec, make_pool, status, ttpeer, wait_for

from ._helpers import job_finished

pytestmark = pytest.mark.slow


def _loads_torch(pid: int) -> bool:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "libtorch" in maps


def _job(home, job_id):
    return next((j for j in status(home)["jobs"] if j["id"] == job_id), None)


def test_killed_paused_and_returning_peers_finish_identically(tmp_path):
    """Carol is SIGKILLed mid-shard; alice and bob close rounds without her (her lease
    expires, her shard is requeued). Then bob is SIGSTOPped mid-shard past his lease and
    alice closes a round alone; bob gets SIGCONT (his stale work must be dropped without
    harm) and carol is restarted with `ttpeer up` (she catches up from her durable state).
    All three finish on the same model."""
    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        # Slowed batches make a shard take long enough to catch a peer in the middle of one.
        homes = make_pool(cluster, url, fp, ["alice", "bob", "carol"], extra=("--slowdown", "4"))
        spec = {**job_spec(rounds=7), "lease": 3.0, "batches": 60}
        job = call(homes[0] / "control.sock", {"op": "submit", "spec": spec, "task_file": None},
                   timeout=120)["job"]

        def busy(home, from_round):
            def check():
                j = _job(home, job)
                return j is not None and j["round"] >= from_round and j["training_shard"] is not None
            return check

        def alice_past(rnd):
            return lambda: _job(homes[0], job)["round"] > rnd

        wait_for(busy(homes[2], 1), 120, "carol to be training a shard", poll=0.02)
        killed_round = _job(homes[0], job)["round"]
        os.killpg(cluster.named["carol"].pid, signal.SIGKILL)
        cluster.named["carol"].wait(timeout=10)
        wait_for(alice_past(killed_round), 120, "a round to close without carol", poll=0.1)

        wait_for(busy(homes[1], killed_round + 1), 120, "bob to be training a shard", poll=0.02)
        paused_round = _job(homes[0], job)["round"]
        os.killpg(cluster.named["bob"].pid, signal.SIGSTOP)
        try:
            wait_for(alice_past(paused_round), 120, "alice to close a round while bob is stopped", poll=0.1)
        finally:
            os.killpg(cluster.named["bob"].pid, signal.SIGCONT)
        assert _job(homes[0], job)["round"] < spec["rounds"], "too few rounds left to show the return"
        cluster.spawn("carol-again", "up", "--home", str(homes[2]), "--slowdown", "4")

        wait_for(lambda: job_finished(homes, job), 240, "all three peers to finish the job", poll=0.25)
        hashes = [ttpeer("export", job, str(h / "out.safetensors"), "--home", str(h))[-1] for h in homes]
        assert len(set(hashes)) == 1 and len(hashes[0]) == 64
        final = _job(homes[0], job)
        assert final["round"] == spec["rounds"]
        assert final["eval_metric"] > 0.3  # it trained: mnist1d starts near 0.1
        # Torch (and so the task's code) ran in the workers, never in a daemon.
        for name in ("alice", "bob", "carol-again"):
            assert not _loads_torch(cluster.named[name].pid), f"{name}'s daemon loaded torch"
    finally:
        cluster.close()
    assert all(p.poll() is not None for p in cluster.procs)
