"""The LAN shortcut (issue 15 point 4, issue 17 point 4) on real processes: a relay over
real TLS and three `ttpeer` daemons on loopback, where every peer reaches every other.

Alice adds a dataset; bob and carol fetch all of it from members directly, none of it
through the relay, and the job trains to bit-identical exports; its initial state and
deltas, too, come from their uploaders directly where they are reachable. Carol advertises an
address nobody can reach (``--direct 192.0.2.1:PORT``, a documentation address): peers
skip her after one connect and are not slowed. A second dataset added by a peer that does
not serve (``--direct off``) comes through the relay, as before."""

from __future__ import annotations

import random
import socket
import textwrap
from pathlib import Path

import pytest

from ttpeer_harness import Cluster, status, ttpeer, wait_for

from ._helpers import job_finished, job_of
from .test_data_processes import _ls

pytestmark = pytest.mark.slow

PIECE = 4096
TASK = '''
import torch
import torch.nn.functional as F
from torch import nn
from ttpeer.train import TaskSpec, dataset_path


def task():
    data = b"".join((dataset_path("corpus") / p).read_bytes() for p in ("a.bin", "sub/b.bin"))
    data += (dataset_path("notes") / "n.bin").read_bytes()
    x = torch.tensor(list(data[: len(data) // 16 * 16]), dtype=torch.float32).view(-1, 16) / 255
    y = (x.sum(dim=1) > 8).long()
    cut = len(x) * 4 // 5
    return TaskSpec(model=lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2)),
                    train=(x[:cut], y[:cut]), test=(x[cut:], y[cut:]), loss=F.cross_entropy,
                    metric=lambda o, t: (o.argmax(-1) == t).float().mean().item(), batch_size=16)
'''


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_peers_that_reach_each_other_fetch_pieces_directly_and_the_rest_use_the_relay(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        lines = ttpeer("pool", "create", "--relay", url, "--fingerprint", fp, "--name", "alice", "--uses", "3",
                       "--home", str(tmp_path / "alice"))
        token = lines[-1]
        homes = {n: tmp_path / n for n in ("alice", "bob", "carol", "dave")}
        cluster.spawn("alice", "up", "--home", str(homes["alice"]))
        cluster.spawn("bob", "join", token, "--name", "bob", "--home", str(homes["bob"]))
        cluster.spawn("carol", "join", token, "--name", "carol", "--home", str(homes["carol"]),
                      "--direct", f"192.0.2.1:{_free_port()}")
        cluster.spawn("dave", "join", token, "--name", "dave", "--home", str(homes["dave"]), "--direct", "off")

        def served(home: Path) -> dict | None:
            return status(home).get("direct")

        def all_in() -> bool:
            return all(len(status(h)["peers"]) == 4 and status(h)["node"]["has_pool_key"] for h in homes.values())

        wait_for(all_in, 60, "four peers to enroll")
        wait_for(lambda: all(served(homes[n]) and served(homes[n])["addrs"] for n in ("alice", "bob", "carol")), 30,
                 "three peers to serve directly")
        wait_for(lambda: all(served(homes[n])["members"] == (3 if n == "dave" else 2) for n in homes), 30,
                 "each to know where the others serve")
        assert served(homes["dave"])["addrs"] == []
        assert served(homes["carol"])["addrs"][0].startswith("192.0.2.1:")

        # Alice adds "corpus": every other peer reaches her and fetches it all directly.
        # Carol adds "notes": she is asked first (its author) but cannot be reached, so its
        # first copies come through the relay; after that members serve each other.
        rng = random.Random(15)
        corpus, notes = tmp_path / "corpus", tmp_path / "notes"
        (corpus / "sub").mkdir(parents=True)
        (corpus / "a.bin").write_bytes(rng.randbytes(5 * PIECE + 100))
        (corpus / "sub" / "b.bin").write_bytes(rng.randbytes(3 * PIECE))
        notes.mkdir()
        (notes / "n.bin").write_bytes(rng.randbytes(3 * PIECE))
        ttpeer("data", "add", str(corpus), "--name", "corpus", "--piece-size", "4K", "--home", str(homes["alice"]))
        ttpeer("data", "add", str(notes), "--name", "notes", "--piece-size", "4K", "--home", str(homes["carol"]))
        wait_for(lambda: "notes" in _ls(homes["alice"]), 30, "carol's dataset record to reach alice")
        task = tmp_path / "two_task.py"
        task.write_text(textwrap.dedent(TASK))
        job = ttpeer("submit", "--task", str(task), "--rounds", "2", "--shards", "4", "--inner-steps", "40",
                     "--batch-size", "32", "--lease", "20s", "--home", str(homes["alice"]))[-1]
        wait_for(lambda: job_finished(homes.values(), job), 120, "the four peers to finish the job", poll=0.25)
        exports = {ttpeer("export", job, str(h / "out.safetensors"), "--home", str(h))[-1] for h in homes.values()}
        assert len(exports) == 1

        size = 8 * PIECE + 100
        for name in ("bob", "carol", "dave"):
            row = _ls(homes[name])["corpus"]
            assert row["here"] == "fetched" and row["fetched_bytes"] == row["direct_bytes"] == size, (name, row)
        assert [d["direct_bytes"] for d in job_of(homes["dave"], job)["data"]] == [size, _ls(homes["dave"])["notes"]
                                                                                   ["direct_bytes"]]
        line = next(x for x in ttpeer("status", "--home", str(homes["alice"])) if x.startswith("direct: "))
        assert line.startswith("direct: serving at 127.0.0.1:") and " pieces (" in line, line
        shown = [line for line in ttpeer("data", "ls", "--home", str(homes["dave"])) if line.startswith("corpus")]
        assert f"{_kib(size)} of it from members directly" in shown[0], shown

        rows = {n: _ls(homes[n])["notes"] for n in ("alice", "bob", "dave")}
        assert all(r["here"] == "fetched" and r["fetched_bytes"] == 3 * PIECE for r in rows.values()), rows
        # Nobody reached carol: at least one whole copy came through the relay.
        assert sum(r["direct_bytes"] for r in rows.values()) <= 2 * 3 * PIECE, rows
        # Every byte fetched directly was served by alice or bob (dave serves nothing, carol
        # is out of reach).
        fetched_direct = sum(_ls(homes[n])[d]["direct_bytes"] for n in ("alice", "bob", "carol", "dave")
                             for d in ("corpus", "notes") if _ls(homes[n])[d]["here"] == "fetched")
        assert served(homes["carol"])["served_bytes"] == 0
        assert served(homes["alice"])["served_bytes"] + served(homes["bob"])["served_bytes"] == fetched_direct

        # The job's blobs too: the initial state from alice, each delta from its trainer, to
        # every member that reaches them; carol's and dave's through the relay.
        for name in ("bob", "carol", "dave"):
            assert served(homes[name])["fetched_blob_bytes"] > 0, (name, served(homes[name]))
        assert served(homes["carol"])["served_blobs"] == served(homes["dave"])["served_blobs"] == 0
        assert (served(homes["alice"])["served_blob_bytes"] + served(homes["bob"])["served_blob_bytes"]
                == sum(served(h)["fetched_blob_bytes"] for h in homes.values()))
        line = next(x for x in ttpeer("status", "--home", str(homes["bob"])) if x.startswith("direct: ") and
                    "fetched from members directly" in x)
        assert "of deltas and states" in line, line
    finally:
        cluster.close()

