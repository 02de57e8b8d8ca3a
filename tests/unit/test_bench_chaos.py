"""scripts/chaos's parts that need no pool: what a seed draws, the cuttable proxy, the
checkers on runs made up here, and the command line's errors."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from bench import chaos
from bench._chaos_check import exits, logs
from bench._chaos_plan import KINDS, NEEDS_ROOT, Fault, draw
from bench._chaos_proxy import proxies
from bench._chaos_run import Result


def test_a_seed_draws_the_same_run_everywhere_and_seeds_differ():
    assert draw(17) == draw(17)
    plans = [draw(s) for s in range(300)]
    assert len({p.describe() for p in plans}) > 250
    assert {p.peers for p in plans} == {3, 4, 5} and {p.mode for p in plans} == {"fused", "ensemble"}
    assert {f.kind for p in plans for f in p.faults} == set(KINDS)  # every kind is drawn
    assert all(1 <= len(p.faults) <= 3 for p in plans if not any(f.kind == "disk_full" for f in p.faults))


def test_without_root_the_same_faults_are_drawn_and_no_home_is_a_tmpfs():
    for seed in range(100):
        rooted, plain = draw(seed, root=True), draw(seed, root=False)
        assert rooted.faults == plain.faults and plain.tmpfs_peer is None
        if any(f.kind == "disk_full" for f in rooted.faults):
            assert rooted.tmpfs_peer is not None


def test_the_admin_stays_and_a_removed_peer_is_removed_once():
    for seed in range(500):
        plan = draw(seed)
        removed = [f.target for f in plan.faults if f.kind in ("revoke", "kill", "disk_full")]
        assert 0 not in removed and len(removed) == len(set(removed)), plan  # one each, never the admin
        disk = [f.target for f in plan.faults if f.kind == "disk_full"]
        assert disk == ([plan.tmpfs_peer] if plan.tmpfs_peer is not None else [])
        assert all(0 <= f.target < plan.peers for f in plan.faults if f.kind in ("kill", "stop", "cut", "revoke"))
        assert list(plan.faults) == sorted(plan.faults, key=lambda f: f.at)
        dead = {f.target for f in plan.faults if f.kind == "relay_kill"}
        assert not dead & {f.target for f in plan.faults if f.kind in ("relay_restart", "corrupt_blob")}, plan


def test_a_fault_says_what_and_when():
    names = ["alice", "bob", "carol", "late"]
    assert Fault("kill", 12.04, 1).describe(names) == "kill(bob)@12s for good"
    assert Fault("stop", 3.0, 2, 7.4).describe(names) == "stop(carol)@3s for 7s"
    assert Fault("relay_restart", 5.0, 1, 2.0).describe(names) == "relay_restart(relay1)@5s for 2s"
    assert Fault("join", 9.0).describe(names) == "join@9s"
    assert Fault("cut", 4.0, 0, 6.0, silent=True).describe(names) == "cut(alice)@4s for 6s silently"


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(4096), b"")],
                             daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def _tunnel(proxy_port: int, port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", proxy_port), timeout=5)
    s.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(1024)
        if not chunk:
            raise ConnectionError("closed during CONNECT")
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return s


def test_a_cut_gate_resets_its_tunnels_and_refuses_new_ones_until_mended():
    srv, port = _echo_server()
    try:
        with proxies() as p:
            gate, other = p.gate(), p.gate()
            s = _tunnel(gate.port, port)
            s.sendall(b"ping")
            assert s.recv(16) == b"ping"
            kept = _tunnel(other.port, port)
            gate.cut()
            with pytest.raises((ConnectionError, OSError)):
                for _ in range(100):  # the reset arrives, then every read or write fails
                    s.sendall(b"x")
                    if not s.recv(16):
                        raise ConnectionError("closed")
            with pytest.raises((ConnectionError, OSError)):
                _tunnel(gate.port, port)
            kept.sendall(b"still")  # another peer's gate is not touched
            assert kept.recv(16) == b"still"
            gate.mend()
            again = _tunnel(gate.port, port)
            again.sendall(b"back")
            assert again.recv(16) == b"back"
            assert gate.refused >= 1
    finally:
        srv.close()


def test_a_silent_cut_drops_bytes_and_leaves_connections_hanging_until_mended():
    srv, port = _echo_server()
    try:
        with proxies() as p:
            gate = p.gate()
            s = _tunnel(gate.port, port)
            gate.cut(silent=True)
            s.settimeout(0.5)
            s.sendall(b"lost")  # no reset: the write succeeds, and nothing comes back
            with pytest.raises(TimeoutError):
                s.recv(16)
            hanging = socket.create_connection(("127.0.0.1", gate.port), timeout=0.5)
            hanging.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
            with pytest.raises(TimeoutError):  # a new CONNECT gets no answer either
                hanging.recv(16)
            gate.mend()
            s.settimeout(5)
            assert s.recv(16) == b""  # the silenced tunnel is reset at the mend, as a timed-out one
            again = _tunnel(gate.port, port)
            again.sendall(b"back")
            assert again.recv(16) == b"back"
    finally:
        srv.close()


def _result(tmp_path: Path, **kw) -> Result:  # type: ignore[no-untyped-def]
    return Result(plan=draw(1), root=tmp_path, **kw)


def test_logs_flag_a_traceback_and_a_secret_and_pass_a_clean_log(tmp_path):
    home = tmp_path / "alice"
    home.mkdir()
    key = bytes(range(32))
    (home / "node.key").write_bytes(key)
    (tmp_path / "alice.log").write_text("alice: all fine\n")
    res = _result(tmp_path, homes={"alice": home}, tokens=["ttp1.abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJ"])
    assert logs(res) == []
    (tmp_path / "bob.log").write_text("Traceback (most recent call last):\n  boom\n")
    (tmp_path / "carol.log").write_text(f"oops {key.hex()} and ttp1.abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJ\n")
    found = logs(res)
    assert any(v.startswith("traceback in bob.log") for v in found)
    assert any(v.startswith("secret in carol.log") and "alice/node.key[0] hex" in v and "token0" in v for v in found)


def test_exits_flag_what_the_schedule_did_not_stop(tmp_path):
    (tmp_path / "erin.log").write_text("error: this machine was revoked from the pool by its admin\n")
    res = _result(tmp_path, exits={"erin": "revoked"}, procs_rc={"erin": 3}, unexpected=[])
    assert exits(res) == []
    res.procs_rc["erin"] = 1
    assert exits(res) == ["erin was revoked and exited with 1, not 3"]
    res.unexpected = ["bob exited with 1"]
    res.disk_exits = ["carol"]
    (tmp_path / "carol.log").write_text("error: something else\n")
    assert exits(res)[0] == "bob exited with 1 (not by the schedule)"
    assert "carol exited on a full disk without saying the disk is full" in exits(res)



def test_the_broken_job_fails_for_the_pool_unless_a_member_never_answers(tmp_path, monkeypatch):
    """Seed 1044: bob killed for good before the broken task came: it never declines, which
    keeps the job open for the pool (proto/_outcome.py); each survivor failing it is enough."""
    from bench import _chaos_check
    from bench._chaos_run import KILLED

    failed_here = {"state": "failed", "ended": None, "declined": "broken_task.py:18 in loss: RuntimeError: boom"}
    jobs = {"good": {"state": "done", "ended": None}, "bad": failed_here}
    monkeypatch.setattr(_chaos_check, "_job", lambda home, job: jobs[job])
    res = _result(tmp_path, job="good", bad_job="bad", survivors=["alice", "carol"],
                  homes={n: tmp_path / n for n in ("alice", "bob", "carol")})
    assert _chaos_check.ended(res) == ["the broken task's job on alice is failed, not failed for the pool"]
    res.exits["bob"] = KILLED
    assert _chaos_check.ended(res) == []
    jobs["bad"] = {**failed_here, "declined": "something else"}
    assert _chaos_check.ended(res)[0].startswith("the broken task's job failed on alice without naming its file")

def test_the_summary_counts_faults_by_kind_and_the_line_names_the_seed(tmp_path):
    join = next(f for f in draw(1).faults if f.kind == "join").describe(draw(1).names)
    res = _result(tmp_path, seconds=42.0, skipped=[f"{join}: the job had ended"])
    line = chaos.line(res, ["ended: job on bob: failed, not done"])
    assert line.startswith("seed 1 ") and "1 VIOLATION " in line and f"skipped: {join}" in line
    rows = chaos.summary([(res, ["x"])])
    join = next(r for r in rows if r.startswith("join "))
    assert join.split()[1:4] == ["1", "0", "1"]  # drawn, injected, runs with a violation


def test_bad_arguments_get_one_clear_line(capsys):
    with pytest.raises(SystemExit) as err:
        chaos.main(["--seed", "seven"])
    assert err.value.code == 2 and "argument --seed: invalid int value: 'seven'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        chaos.main(["--runs", "0"])
    assert "--runs must be at least 1" in capsys.readouterr().err
    assert set(NEEDS_ROOT) <= set(KINDS)
