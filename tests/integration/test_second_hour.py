"""The second hour on real processes: a pool of three homes (alice, bob, carol), then the
mistakes and accidents people meet, each checked as the user reads it.

- A task whose data is only on alice fails on bob and carol: ``wait`` on alice says the
  job is done *without* them, names each with its reason, exits 4, and ``--json`` lists them.
- carol is SIGKILLed mid-job: alice's ``status`` shows her ``silent since`` with what
  becomes of her shards, and no longer lists her as "not started yet".
- dave joins after the first job ended: he never loads it; ``status`` calls it skipped and
  ``wait`` says why.
- Ctrl-C at alice's terminal (SIGINT to her whole process group, workers included) and
  SIGTERM to dave stop them with no traceback and no false failure from any process.
- ``status`` of alice's stopped home says to start it with ``'ttpeer up --home ALICE'``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import textwrap
from pathlib import Path

import pytest

from ttpeer.cli import main
from ttpeer_harness import READY_TIMEOUT, Cluster, make_pool, status, ttpeer, wait_for

from ._helpers import job_of

pytestmark = pytest.mark.slow

ALICE_ONLY = '''
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from ttpeer.train import TaskSpec


def _daemon_home():
    """The --home of the daemon that runs this worker (its parent): each home is another
    machine here, and the data file is in alice's only."""
    argv = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")
    return Path(argv[argv.index(b"--home") + 1].decode())


def _data(count, seed):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (count,), generator=gen)
    return torch.randn(count, 8, generator=gen) + y[:, None].float(), y


def task():
    corpus = _daemon_home() / "corpus.txt"
    if not corpus.exists():
        raise FileNotFoundError(f"data path {corpus} does not exist on this machine")
    return TaskSpec(model=lambda: nn.Linear(8, 4), train=_data(256, 1), test=_data(64, 2),
                    loss=F.cross_entropy, metric=lambda o, t: (o.argmax(-1) == t).float().mean().item(),
                    batch_size=16)
'''


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def _peer_line(home: Path, name: str) -> str:
    _code, out, _err = _cli("status", "--home", str(home))
    return next((line for line in out.splitlines() if line.strip().startswith(name + " ")), "")


def test_the_second_hour(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        alice, bob, carol = make_pool(cluster, url, fp, ["alice", "bob", "carol"])
        (alice / "corpus.txt").write_text("only alice has this file\n")
        task = tmp_path / "alice_only.py"
        task.write_text(textwrap.dedent(ALICE_ONLY))

        # 1. Done on fewer peers than started it: wait says so, names them, exits 4.
        first = ttpeer("submit", "--task", str(task), "--rounds", "2", "--shards", "3", "--inner-steps", "3",
                       "--lease", "10s", "--home", str(alice))[-1]
        wait_for(lambda: len((job_of(alice, first) or {}).get("declines") or []) == 2, 90,
                 "bob and carol to fail the job")
        code, out, err = _cli("wait", first, "--timeout", "120s", "--home", str(alice))
        assert code == 4, (out, err)
        assert out.startswith(f"job {first[:12]} done without bob, carol: 2 rounds, ")
        for who in ("bob", "carol"):
            assert f"failed on {who} (" in err and "does not exist on this machine" in err
        code, out, _err = _cli("wait", first, "--json", "--home", str(alice))
        said = json.loads(out)
        assert code == 4 and said["state"] == "done"
        assert sorted(p["name"] for p in said["failed_peers"]) == ["bob", "carol"]

        # 5. A peer killed mid-job is shown silent, with what becomes of its shards.
        second = ttpeer("submit", "--task", "mnist1d", "--rounds", "400", "--shards", "3", "--inner-steps", "30",
                        "--lease", "10s", "--home", str(alice))[-1]
        wait_for(lambda: (job_of(carol, second) or {}).get("state") == "running", 90, "carol to run the job")
        os.killpg(cluster.named["carol"].pid, signal.SIGKILL)
        cluster.named["carol"].wait(timeout=10)
        line = wait_for(lambda: "silent since" in (seen := _peer_line(alice, "carol")) and seen, 60,
                        "alice to show carol silent")
        assert "the shards it claimed" in line, line
        _code, out, _err = _cli("status", "--home", str(alice))
        assert not any("not started yet" in s and "carol" in s for s in out.splitlines()), out

        # 4. A machine that joins after the first job ended skips it.
        token = ttpeer("invite", "--home", str(alice))[-1]
        dave = tmp_path / "dave"
        cluster.spawn("dave", "join", token, "--name", "dave", "--home", str(dave))
        wait_for(lambda: (job_of(dave, first) or {}).get("state") == "skipped", READY_TIMEOUT,
                 "dave to see the first job as skipped")
        code, _out, err = _cli("wait", first, "--home", str(dave))
        assert code == 1 and "submitted before this machine joined and finished without it" in err, err
        assert not (dave / "states" / first).exists()

        # 2. Ctrl-C at alice's terminal reaches her workers too; SIGTERM to dave's daemon.
        wait_for(lambda: status(alice)["workers"], 60, "alice's workers to run")
        os.killpg(cluster.named["alice"].pid, signal.SIGINT)
        cluster.named["dave"].send_signal(signal.SIGTERM)
        for name in ("alice", "dave"):
            assert cluster.named[name].wait(timeout=30) == 0, name
        for name in ("alice", "bob", "dave"):
            log = (tmp_path / f"{name}.log").read_text(errors="replace")
            assert "Traceback" not in log, (name, log[-3000:])
            assert "failed on this peer" not in log.replace(f"job {first[:12]} failed", ""), (name, log[-3000:])

        # 6. What ttpeer suggests runs as printed: it carries the --home given.
        code, _out, err = _cli("status", "--home", str(alice))
        assert code == 1 and f"(start it with 'ttpeer up --home {alice}')" in err, err
    finally:
        cluster.close()
