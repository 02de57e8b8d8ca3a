"""Durable state, with real processes and real files.

- SIGKILL at many points of a real job (during start-up, log replay, training,
  aggregation, state writes: wherever the kill lands), restarting with
  ``ttpeer up`` each time: after every kill the killed peer's record log and
  states are whole, and the job ends bit-identical on both peers.
- A corrupted state file and a truncated record log are found at start-up,
  reported, never used, and repaired from the peers.
- A full disk stops the daemon with a clear message, and nothing already
  written is lost: freed, it resumes and finishes.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ttpeer.daemon import call
from ttpeer.daemon.node._recordlog import _HEAD
from ttpeer.daemon.service._integrity import scan_log
from ttpeer.errors import TtpeerError
from ttpeer_harness import Cluster, job_spec, make_pool, status, ttpeer, wait_for

from ._helpers import audit_home, job_finished, job_of

pytestmark = pytest.mark.slow
KILLS = 12
ROUNDS = 14  # the kills are paced over its first ROUNDS-3 rounds (``_kill_round``); the rest runs with both peers


def _kill_round(i: int) -> int:
    """Alice's round that kill ``i`` waits for: the kills spread over the job's first
    ROUNDS-3 rounds by progress, not by time, so they land during the job and across
    many rounds however fast or slow this machine trains and bob starts."""
    return i * (ROUNDS - 3) // KILLS


def _submit(home: Path, **changes) -> str:
    spec = {**job_spec(rounds=3), **changes}
    return call(home / "control.sock", {"op": "submit", "spec": spec, "task_file": None}, timeout=120)["job"]


def _done_everywhere(homes: list[Path], job: str, timeout: float) -> list[str]:
    wait_for(lambda: job_finished(homes, job), timeout, f"job {job[:12]} to finish on every peer", poll=0.25)
    return [ttpeer("export", job, str(h / "out.safetensors"), "--home", str(h))[-1] for h in homes]


def _round(home: Path, job: str) -> int:
    j = job_of(home, job)
    return -1 if j is None else j["round"]


def _snapshot(home: Path, job: str) -> str | None:
    """What the daemon says it is doing, or None while it does not answer yet."""
    try:
        j = job_of(home, job)
    except (TtpeerError, OSError):
        return None
    if j is None:
        return "replaying"
    if j["training_shard"] is not None:
        return f"training r{j['round']}s{j['training_shard']}"
    return f"{j['state']} r{j['round']}"


def test_sigkill_at_many_points_never_corrupts_and_the_job_finishes(tmp_path):
    rng = random.Random(6)
    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        homes = make_pool(cluster, url, fp, ["alice", "bob"], extra=("--slowdown", "12"))
        alice, bob = homes
        job = _submit(alice, rounds=ROUNDS, shards=4, batches=20, lease=2.0)
        points: list[tuple[float, str, int]] = []
        proc = cluster.named["bob"]
        started = time.monotonic()
        for i in range(KILLS):
            if i % 3 == 0:  # somewhere in start-up (imports, the home check, log replay, connecting): timed
                # from bob's spawn, so it lands near the previous kill's round
                time.sleep(rng.uniform(0.3, 2.0))
                doing = "start-up"
            else:  # somewhere in the job, once alice is at this kill's round and before the next kill's
                wait_for(lambda: _snapshot(bob, job) is not None, 60, "bob to answer")
                target = _kill_round(i)
                wait_for(lambda r=target: _round(alice, job) >= r, 120, f"alice to reach round {target}")
                until = time.monotonic() + rng.uniform(0.0, 2.5)
                doing = _snapshot(bob, job) or "?"
                while time.monotonic() < until and _round(alice, job) < _kill_round(i + 1):
                    doing = _snapshot(bob, job) or doing
                    time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            points.append((round(time.monotonic() - started, 1), doing, _round(alice, job)))
            audit_home(bob)  # every kill leaves whole files
            proc = cluster.spawn(f"bob-{i + 1}", "up", "--home", str(bob), "--slowdown", "12")
        hashes = _done_everywhere(homes, job, 240)
    finally:
        cluster.close()
    assert hashes[0] == hashes[1]
    counts = audit_home(bob)
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("bob*.log"))
    assert "is damaged" not in logs and "is corrupt" not in logs and "Traceback" not in logs
    rounds = [r for _, _, r in points]
    during = sum(1 for r in rounds if r < ROUNDS)
    print(f"\n{len(points)} SIGKILL points (t s, bob doing, alice's round):")
    print("  " + "; ".join(f"{t} {d} @{r}" for t, d, r in points))
    print(f"  {during} while the job ran; torn tails cut on restart: {logs.count('torn frame')}; "
          f"bob's log at the end: {counts['records']} records, {counts['states']} states, all whole")
    assert len(points) == KILLS and during >= KILLS - 1 and len(set(rounds)) >= 6  # spread over the job


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def _tear(log: Path, at: float) -> int:
    """Cut the record log inside the frame that lies ``at`` (a fraction) of the way in:
    through its record bytes, never on a frame boundary (frame sizes vary per run), so
    there is always a torn frame. Returns how many whole frames the log held."""
    frames = scan_log(log.read_bytes()).frames
    starts = [0]
    for raw in frames:
        starts.append(starts[-1] + _HEAD.size + len(raw))
    k = next(n for n in range(len(frames)) if starts[n + 1] > starts[-1] * at)
    cut = starts[k] + _HEAD.size + len(frames[k]) // 2
    with open(log, "r+b") as f:
        f.truncate(cut)
    torn = scan_log(log.read_bytes())
    assert starts[k] < cut < starts[k + 1] and torn.problem == "torn" and len(torn.frames) == k, (cut, starts[k])
    return len(frames)


def test_corrupt_states_and_a_truncated_log_are_reported_and_repaired_from_peers(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        homes = make_pool(cluster, url, fp, ["alice", "bob"], extra=("--slowdown", "6"))
        alice, bob = homes
        job = _submit(alice, rounds=6, shards=4, batches=20, lease=3.0)
        wait_for(lambda: _round(bob, job) >= 3, 120, "three rounds")
        os.killpg(cluster.named["bob"].pid, signal.SIGKILL)
        cluster.named["bob"].wait(timeout=10)
        states = sorted((bob / "states" / job).glob("*.state"))
        assert states
        for st in states:  # every state bob holds is damaged: he must get one from his peers
            _flip(st, st.stat().st_size // 2)
        before = _tear(bob / "records.log", 2 / 5)  # most records gone, the last one kept torn
        cluster.spawn("bob-again", "up", "--home", str(bob), "--slowdown", "6")
        wait_for(lambda: status(bob)["startup_repairs"], 60, "bob's start-up check")
        repairs = status(bob)["startup_repairs"]
        hashes = _done_everywhere(homes, job, 180)
    finally:
        cluster.close()
    assert hashes[0] == hashes[1]
    text = "\n".join(repairs)
    assert len(repairs) == 1 + len(states), repairs
    assert "torn frame" in text and text.count("is corrupt") == len(states)
    assert len(list((bob / "quarantine" / job).iterdir())) == len(states)
    bob_log = (tmp_path / "bob-again.log").read_text()
    assert bob_log.count("ERROR ttpeer.integrity") == len(states)  # reported where an operator looks
    after = audit_home(bob)
    assert after["records"] >= before  # the records cut off came back from alice
    print(f"\nrepaired at start: {len(states)} corrupt states, a log cut from {before} records; "
          f"bob ended with {after['records']} records and the same model")


@pytest.mark.skipif(os.geteuid() != 0, reason="a small tmpfs for the home needs root (mount)")
def test_a_full_disk_stops_the_daemon_clearly_and_loses_nothing(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        alice = make_pool(cluster, url, fp, ["alice"], extra=("--slowdown", "6"))[0]
        token = ttpeer("invite", "--home", str(alice))[-1]
        bob = disk / "bob"
        cluster.spawn("bob", "join", token, "--name", "bob", "--home", str(bob), "--slowdown", "6")
        wait_for(lambda: status(bob)["node"]["has_pool_key"], 60, "bob to join")
        job = _submit(alice, rounds=5, shards=4, batches=20, lease=3.0)
        held = bob / "states" / job
        wait_for(lambda: len(list(held.glob("*.state"))) >= 2, 120, "bob to hold two states")
        filler = disk / "filler"
        with open(filler, "wb") as f:  # take every free byte
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        assert cluster.named["bob"].wait(timeout=60) == 1
        out = (tmp_path / "bob.log").read_text()
        before = audit_home(bob)  # what was written before the disk filled is whole
        filler.unlink()
        cluster.spawn("bob-again", "up", "--home", str(bob), "--slowdown", "6")
        hashes = _done_everywhere([alice, bob], job, 180)
    finally:
        cluster.close()
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert "error: could not write" in out and "No space left on device" in out and "the disk is full" in out
    assert "Traceback" not in out
    assert before["states"] >= 2 and before["records"] > 0
    assert hashes[0] == hashes[1]
    print(f"\nfull disk: bob stopped with {out.strip().splitlines()[-1]!r}; "
          f"{before['records']} records and {before['states']} states intact; resumed and finished")
