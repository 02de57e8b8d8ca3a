"""Data that reaches the peers (issue 17), on real processes: a relay over real TLS and three
`ttpeer` daemons on loopback.

Alice (the admin) adds a folder with `ttpeer data add`; bob and carol have no copy. A task
file reads it through `ttpeer.train.dataset_path`; the job trains on all three, which export
bit-identical models. Bob and carol fetched every piece (status and `data ls` say so), and
one piece that the relay serves damaged is refused, counted, asked for again, uploaded
again by alice, and fetched.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import random
import textwrap
from pathlib import Path

import pytest
import torch

import ttpeer as ttpeer_api
from ttpeer.cli import main
from ttpeer.daemon.service._integrity import scan_log
from ttpeer.errors import UsageError
from ttpeer.proto import parse
from ttpeer_harness import Cluster, make_pool, ttpeer, wait_for

from ._helpers import job_finished, job_of

pytestmark = pytest.mark.slow

TASK = '''
import torch
import torch.nn.functional as F
from torch import nn
from ttpeer.train import TaskSpec, dataset_path


def _windows():
    root = dataset_path("corpus")
    data = b"".join((root / p).read_bytes() for p in ("a.bin", "sub/b.bin"))
    x = torch.tensor(list(data[: len(data) // 16 * 16]), dtype=torch.float32).view(-1, 16) / 255
    y = (x.sum(dim=1) > 8).long()
    return x, y


def task():
    x, y = _windows()
    cut = len(x) * 4 // 5
    return TaskSpec(model=lambda: nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 2)),
                    train=(x[:cut], y[:cut]), test=(x[cut:], y[cut:]), loss=F.cross_entropy,
                    metric=lambda o, t: (o.argmax(-1) == t).float().mean().item(), batch_size=16)
'''
PIECE = 4096


def _folder(root: Path) -> Path:
    rng = random.Random(17)
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(rng.randbytes(5 * PIECE + 100))
    (root / "sub" / "b.bin").write_bytes(rng.randbytes(3 * PIECE))
    (root / ".hidden").write_bytes(b"skipped")
    return root


def _cli(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(args))
    return code, err.getvalue()


def _ls(home: Path) -> dict[str, dict]:
    listing = json.loads("\n".join(ttpeer("data", "ls", "--json", "--home", str(home))))
    return {d["name"]: d for d in listing["datasets"]}


def test_a_dataset_added_on_one_peer_trains_on_three(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        # The relay's path, damaged pieces and all: no peer serves pieces directly here
        # (tests/integration/test_direct_processes.py is the LAN shortcut's).
        homes = make_pool(cluster, url, fp, ["alice", "bob", "carol"], extra=("--direct", "off"))
        alice, bob, carol = homes
        relay_blobs = tmp_path / "relay"  # the relay's --data: pools/<pool>/blobs/<sha256>

        def blob_files() -> list[Path]:
            return [p for p in relay_blobs.rglob("*") if p.parent.name == "blobs" and len(p.name) == 64]

        before = {p.name for p in blob_files()}
        # Mistakes are one line on the terminal, and the daemon goes on.
        code, err = _cli("data", "add", str(tmp_path / "nowhere"), "--home", str(alice))
        assert code == 1 and err.strip() == f"error: {tmp_path / 'nowhere'} does not exist", err
        (tmp_path / "empty").mkdir()
        code, err = _cli("data", "add", str(tmp_path / "empty"), "--name", "e", "--home", str(alice))
        assert code == 1 and "holds no files to add" in err, err
        corpus = _folder(tmp_path / "corpus")
        out = ttpeer("data", "add", str(corpus), "--name", "corpus", "--piece-size", "4K", "--home", str(alice))
        assert out[0].startswith("added dataset corpus: 2 files") and "9 pieces" in out[0], out
        dataset = out[-1].split()[-1]
        # The same files added again: the same id, nothing new.
        again = ttpeer("data", "add", str(corpus), "--name", "corpus", "--piece-size", "4K", "--home", str(alice))
        assert again[0].startswith("already added") and again[-1].split()[-1] == dataset

        # The relay now serves one of the pieces damaged (same size, one byte changed).
        pieces = sorted(p for p in blob_files() if p.name not in before)
        assert len(pieces) == 9, [p.name for p in pieces]
        damaged = pieces[3]
        raw = bytearray(damaged.read_bytes())
        raw[-1] ^= 0xFF
        damaged.write_bytes(bytes(raw))

        task = tmp_path / "corpus_task.py"
        task.write_text(textwrap.dedent(TASK))
        # Long enough (about 20 s of steps for one peer here) that bob and carol, who fetch
        # first, also train.
        job = ttpeer("submit", "--task", str(task), "--rounds", "4", "--shards", "6", "--inner-steps", "100",
                     "--batch-size", "32", "--lease", "20s", "--home", str(alice))[-1]
        wait_for(lambda: job_finished(homes, job), 120, "the three peers to finish the job", poll=0.25)

        hashes = [ttpeer("export", job, str(h / "out.safetensors"), "--home", str(h))[-1] for h in homes]
        assert len(set(hashes)) == 1 and len(hashes[0]) == 64
        records = [parse(raw) for raw in scan_log((alice / "records.log").read_bytes()).frames]
        names = {r["node"]: r["name"] for r in records if r.kind == "join"}
        trained = {names.get(r.author, "alice") for r in records if r.kind == "contrib" and r["job"] == job}
        assert trained & {"bob", "carol"}, trained  # a peer that fetched the data trained on it
        assert job_of(alice, job)["data"][0]["here"] == "added"
        for home in (bob, carol):
            [d] = job_of(home, job)["data"]
            assert (d["name"], d["id"], d["here"], d["pieces_here"]) == ("corpus", dataset, "fetched", 9)
            assert d["fetched_bytes"] == 8 * PIECE + 100
            shown = [line for line in ttpeer("status", "--home", str(home)) if line.startswith("    data: corpus")]
            assert shown and f"({dataset[:12]}) 9/9 pieces of 32.1 KiB here, fetched 32.1 KiB" in shown[0], shown
            row = _ls(home)["corpus"]
            assert row["here"] == "fetched" and row["fetched_bytes"] == 8 * PIECE + 100
            files = home / "datasets" / dataset / "files"
            for rel in ("a.bin", "sub/b.bin"):
                assert hashlib.sha256((files / rel).read_bytes()).digest() == \
                    hashlib.sha256((corpus / rel).read_bytes()).digest()
            assert not (files / ".hidden").exists()
        # The damaged piece was refused by whoever met it first, and fetched again once
        # alice had uploaded it again.
        refused = sum(_ls(h)["corpus"]["bad_pieces"] for h in (bob, carol))
        assert refused >= 1
        assert _ls(alice)["corpus"]["uploaded_again"] >= 1

        # The export loads without a daemon on any peer that holds the data (dataset_path
        # read from the home), and says what is missing where it is not held.
        model = ttpeer_api.load(carol / "out.safetensors", task=task, home=carol)
        assert isinstance(model, torch.nn.Module)
        with pytest.raises(UsageError, match=r"reads dataset 'corpus' \(dataset_path\), which this machine's"):
            ttpeer_api.load(carol / "out.safetensors", task=task, home=tmp_path / "nohome")

        # data rm: the copy goes; with --withdraw from the author, the record too.
        ttpeer("data", "rm", "corpus", "--home", str(bob))
        assert _ls(bob)["corpus"]["here"] == "no"
        ttpeer("data", "rm", "corpus", "--withdraw", "--home", str(alice))
        wait_for(lambda: "corpus" not in _ls(bob), 30, "the withdrawal to reach bob")
    finally:
        cluster.close()
