"""The first hour, as a newcomer lives it: the README's commands on real processes (a
relay, an admin, a member that joins with the token on stdin), each with the mistakes
people make on the way, and no traceback anywhere.

What it shows: the member's daemon holds no token in its argv or environment; client
commands answer without importing torch; mistyped flags get "did you mean"; a model
trained from the guide's task file (docs/guide/2-tasks.md) loads and predicts without being told where the
task file is, and a commented copy is named as a different file; sidecars and the
report say what the job was (fused or ensemble); a daemon whose relay is gone stops
within 3 s of SIGTERM, even with a claim in flight.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ttpeer_harness import Cluster, status, wait_for

pytestmark = pytest.mark.slow

TASKS_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "2-tasks.md"


def _guide_task() -> str:
    """The task file the guide shows, exactly (so the guide's example is what is tested)."""
    found = re.search(r'```python\n("""my_task\.py.*?)```', TASKS_GUIDE.read_text(), re.S)
    assert found, "the guide's my_task.py example is missing"
    return found.group(1)


class Walk:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.errors: list[str] = []  # every stderr seen, checked for tracebacks at the end

    def ttpeer(self, *args: str, ok: bool = True, stdin: str | None = None,
               shell: str | None = None) -> subprocess.CompletedProcess[str]:
        cmd = shell or [sys.executable, "-m", "ttpeer", *args]
        out = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=self.cluster.env,
                             timeout=120, shell=shell is not None)
        self.errors.append(out.stderr)
        assert "Traceback" not in out.stderr, out.stderr
        if ok:
            assert out.returncode == 0, f"ttpeer {args}: {out.stderr}"
        return out

    def mistake(self, *args: str, says: str, code: int | None = None) -> str:
        out = self.ttpeer(*args, ok=False)
        lines = out.stderr.strip().splitlines()
        assert out.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), (args, out.stderr)
        assert says in lines[0], (args, lines[0])
        if code is not None:
            assert out.returncode == code
        return lines[0]


def _job_state(home: Path, job: str) -> dict | None:
    return next((j for j in status(home)["jobs"] if j["id"] == job), None)


def test_newcomer_walk(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    walk = Walk(cluster)
    alice, bob = tmp_path / "alice", tmp_path / "bob"
    try:
        url, fp = cluster.start_relay()
        other = "sha256:" + "0" * 64
        said = walk.mistake("pool", "create", "--relay", url, "--fingerprint", other, "--home", str(alice),
                            says="the relay at")
        assert "token" not in said
        walk.mistake("pool", "create", "--relay", "https://127.0.0.1:9", "--fingerprint", fp, "--home",
                     str(alice), says="cannot reach the relay at https://127.0.0.1:9: connection refused")
        walk.mistake("pool", "create", "--relay", url, "--fingerprnt", fp, says="did you mean --fingerprint?",
                     code=2)
        walk.mistake("--home", str(tmp_path / "nowhere"), "up", says="does not exist")
        token = walk.ttpeer("pool", "create", "--relay", url, "--fingerprint", fp, "--name", "alice",
                            "--home", str(alice)).stdout.splitlines()[-1]
        cluster.spawn("alice", "up", "--home", str(alice))
        # The safe form first: the token on stdin, never in argv.
        bob_proc = subprocess.Popen([sys.executable, "-m", "ttpeer", "join", "-", "--name", "bob", "--home",
                                     str(bob)], stdin=subprocess.PIPE, stdout=open(tmp_path / "bob.log", "wb"),
                                    stderr=subprocess.STDOUT, env={**cluster.env, "TTPEER_TOKEN": token},
                                    start_new_session=True)
        cluster.procs.append(bob_proc)
        assert bob_proc.stdin is not None
        bob_proc.stdin.write(token.encode() + b"\n")
        bob_proc.stdin.close()
        wait_for(lambda: all(status(h)["node"]["has_pool_key"] and len(status(h)["peers"]) == 2
                             for h in (alice, bob)), 60, "bob to enroll")
        for part in ("cmdline", "environ"):
            held = Path(f"/proc/{bob_proc.pid}/{part}").read_bytes()
            assert token[5:40].encode() not in held, f"bob's daemon keeps the token in its {part}"
        assert b"up" in Path(f"/proc/{bob_proc.pid}/cmdline").read_bytes().split(b"\0")

        # Client commands: quick, and no torch (the torch-free check itself is in tests/unit).
        started = time.monotonic()
        walk.ttpeer("status", "--home", str(bob))
        status_s = time.monotonic() - started
        piped = walk.ttpeer(shell=f"{sys.executable} -m ttpeer status --home {bob} | head -1")
        assert piped.stdout.startswith("node bob")
        walk.mistake("status", "--home", str(tmp_path / "nowhere"), says="does not exist")
        walk.mistake("wait", "deadbeef", "--home", str(bob), says="no job 'deadbeef'")

        task = tmp_path / "my_task.py"
        task.write_text(_guide_task())
        walk.mistake("submit", "--task", str(task), "--rouns", "2", "--home", str(alice),
                     says="did you mean --rounds?", code=2)
        walk.mistake("submit", "--task", str(task), "--round", "2", "--home", str(alice),
                     says="did you mean --rounds?", code=2)
        job = walk.ttpeer("submit", "--task", str(task), "--rounds", "2", "--inner-steps", "10", "--shards", "2",
                          "--home", str(alice)).stdout.splitlines()[-1]
        walk.ttpeer("wait", job[:12], "--timeout", "120", "--home", str(bob))
        wait_for(lambda: all(_job_state(h, job)["state"] == "done" for h in (alice, bob)), 60, "both done")

        out = tmp_path / "out"
        out.mkdir()
        walk.mistake("export", "deadbeef", str(out / "x"), "--home", str(bob), says="no job 'deadbeef'")
        walk.ttpeer("export", job, str(out / "p"), "--home", str(bob))
        walk.ttpeer("export", job, str(out / "p.safetensors"), "--home", str(bob))  # the same files again
        side = json.loads((out / "p.json").read_text())
        assert side["model_file"] == "p.safetensors" and side["mode"] == "fused"
        assert side["task_file"] == "my_task.py" and (out / "p.task.py").read_bytes() == task.read_bytes()
        rows = tmp_path / "rows.csv"
        rows.write_text("\n".join(",".join(["0.1"] * 64) for _ in range(3)) + "\n")
        moved = tmp_path / "elsewhere"
        moved.mkdir()
        (out / "p.safetensors").rename(moved / "p.safetensors")
        (out / "p.json").rename(moved / "p.json")
        predicted = walk.ttpeer("predict", str(moved / "p.safetensors"), str(rows), "--home", str(bob))
        assert len(predicted.stdout.splitlines()) == 3  # found in bob's home by its hash
        (moved / "my_task.py").write_text(_guide_task() + "# a comment\n")
        said = walk.mistake("predict", str(moved / "p.safetensors"), str(rows), "--home", str(tmp_path / "none"),
                            says="is a different file")
        assert "my_task.py" in said

        ens = walk.ttpeer("submit", "--task", str(task), "--mode", "ensemble", "--members", "2", "--rounds",
                          "1", "--inner-steps", "20", "--home", str(alice)).stdout
        ens_job = ens.splitlines()[-1]
        walk.ttpeer("wait", ens_job, "--timeout", "120", "--home", str(bob))
        wait_for(lambda: _job_state(bob, ens_job)["state"] == "done", 60, "the ensemble done")
        walk.ttpeer("export", ens_job, str(out / "ens.safetensors"), "--home", str(bob))
        ens_side = json.loads((out / "ens.json").read_text())
        assert ens_side["mode"] == "ensemble" and ens_side["model_file"] == "ens.safetensors"
        walk.ttpeer("report", ens_job, str(out / "ens.html"), "--home", str(bob))
        page = (out / "ens.html").read_text()
        assert "Nesterov" not in page and "int8" not in page and "member checkpoints" in page
        assert "2 members x 20 AdamW steps" in page

        # A long job, the relay killed during a shard: SIGTERM stops bob within 3 s.
        long_job = walk.ttpeer("submit", "--task", str(task), "--rounds", "50", "--inner-steps", "5000",
                               "--shards", "2", "--home", str(alice)).stdout.splitlines()[-1]
        walk.ttpeer("report", long_job, str(out / "long.html"), "--home", str(alice))
        assert "so far (0 rounds closed)" in (out / "long.html").read_text()
        wait_for(lambda: (_job_state(bob, long_job) or {}).get("training_shard") is not None, 60,
                 "bob to train a shard")
        relay = cluster.named["relay"]
        os.killpg(relay.pid, signal.SIGKILL)
        relay.wait()
        wait_for(lambda: not status(bob)["relay"]["connected"], 30, "bob to see the relay gone")
        started = time.monotonic()
        os.killpg(bob_proc.pid, signal.SIGTERM)
        bob_proc.wait(timeout=30)
        stop_s = time.monotonic() - started
        assert stop_s < 3.0, f"bob took {stop_s:.1f} s to stop with the relay gone"
        assert bob_proc.returncode == 0
    finally:
        cluster.close()
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
    assert "Traceback" not in logs and "Traceback" not in "".join(walk.errors)
    assert token[5:40] not in logs
    print(f"status took {status_s:.2f} s; bob stopped {stop_s:.2f} s after SIGTERM")

