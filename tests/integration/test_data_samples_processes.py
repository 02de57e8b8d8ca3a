"""A dataset read sample by sample (issue 17, point 2), on real processes: a relay over
real TLS and three `ttpeer` daemons on loopback, each training in worker processes.

Alice adds a text file of 40,000 samples (a line each) with `data add --format lines`; bob
and carol have no copy. The task reads it with `dataset_samples` and holds the last 400
lines out as its test set. The job trains fewer samples than the file holds, so a peer
needs only the pieces of the shards it trains (and of the test set): bob and carol each
fetch a part of the file, not all of it, and the three export bit-identical models.
"""

from __future__ import annotations

import random
import textwrap

import pytest

from ttpeer.daemon.service._integrity import scan_log
from ttpeer.proto import parse
from ttpeer_harness import Cluster, make_pool, ttpeer, wait_for

from ._helpers import job_finished, job_of

pytestmark = pytest.mark.slow

TASK = '''
import torch
import torch.nn.functional as F
from torch import nn
from ttpeer.train import TaskSpec, dataset_samples


def parse(raw):
    values = raw.split()
    return torch.tensor([float(v) for v in values[:-1]]), int(values[-1])


def task():
    train, test = dataset_samples("corpus", transform=parse).split(test=400)
    return TaskSpec(model=lambda: nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2)),
                    train=train, test=test, loss=F.cross_entropy,
                    metric=lambda o, t: (o.argmax(-1) == t).float().mean().item(), batch_size=16)
'''
PIECE = 16384
LINES = 40000


def _corpus(path):
    rng = random.Random(5)
    rows = []
    for _ in range(LINES):
        x = [rng.uniform(-1, 1) for _ in range(8)]
        rows.append(" ".join(f"{v:.3f}" for v in x) + f" {int(sum(x[:4]) > sum(x[4:]))}")
    path.write_text("\n".join(rows) + "\n")
    return path.stat().st_size


def test_peers_fetch_only_the_pieces_of_the_shards_they_train(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        homes = make_pool(cluster, url, fp, ["alice", "bob", "carol"])
        alice, bob, carol = homes
        size = _corpus(tmp_path / "corpus.txt")
        pieces = -(-size // PIECE)
        out = ttpeer("data", "add", str(tmp_path / "corpus.txt"), "--name", "corpus", "--piece-size", "16K",
                     "--format", "lines", "--home", str(alice))
        assert out[0].startswith("added dataset corpus: 1 files") and f"{pieces} pieces, {LINES} samples as lines" \
            in out[0], out
        dataset = out[-1].split()[-1]

        task = tmp_path / "corpus_task.py"
        task.write_text(textwrap.dedent(TASK))
        # 8 rounds x 6 shards x 100 steps x 8 = 38,400 samples trained of 39,600: under one
        # epoch across the pool, so each peer trains a part of the pieces.
        job = ttpeer("submit", "--task", str(task), "--rounds", "8", "--shards", "6", "--inner-steps", "100",
                     "--batch-size", "8", "--lease", "20s", "--home", str(alice))[-1]
        wait_for(lambda: job_finished(homes, job), 150, "the three peers to finish the job", poll=0.25)

        hashes = [ttpeer("export", job, str(h / "out.safetensors"), "--home", str(h))[-1] for h in homes]
        assert len(set(hashes)) == 1 and len(hashes[0]) == 64
        records = [parse(raw) for raw in scan_log((alice / "records.log").read_bytes()).frames]
        names = {r["node"]: r["name"] for r in records if r.kind == "join"}
        shards = {}
        for r in records:
            if r.kind == "contrib" and r["job"] == job:
                who = names.get(r.author, "alice")
                shards[who] = shards.get(who, 0) + len(r["shards"])
        [rec] = [r for r in records if r.kind == "job" and r.id == job]
        assert set(rec["samples"]) == {"corpus"} and rec["datasets"] == {"corpus": dataset}
        for name, home in (("bob", bob), ("carol", carol)):
            [d] = job_of(home, job)["data"]
            assert d["name"] == "corpus" and d["id"] == dataset
            # It holds what it trained and the test set's pieces, not the whole file.
            assert 0 < d["pieces_here"] < pieces, (name, d, shards)
            assert d["fetched_bytes"] < size * 0.8, (name, d, shards)
            if shards.get(name):
                assert d["fetched_bytes"] > 0
        assert shards.get("bob", 0) + shards.get("carol", 0) > 0, shards
    finally:
        cluster.close()
