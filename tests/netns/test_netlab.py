"""ttpeer across a network lab: a relay, two peers behind NAT routers, one peer whose
only way out is an HTTP CONNECT proxy, each in its own network namespace, links
shaped with tbf and a delaying forwarder (see ``ttpeer_harness/netlab.py``).

Root only (CI runs as root); elsewhere every test skips with the reason. One lab and
one pool serve the module; every namespace and process is removed afterwards, also
when a test fails (checked for a lab that fails on purpose).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration._helpers import audit_home, job_finished
from ttpeer.daemon import call
from ttpeer.errors import TtpeerError
from ttpeer_harness import job_spec, status, ttpeer, wait_for
from ttpeer_harness.netlab import (
    PREFIX,
    RELAY_ADDR,
    Lab,
    LabError,
    down,
    lab_namespaces,
    start_pool,
    start_relay,
    unavailable,
)

WHY_NOT = unavailable()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

NAT, PROXIED = ["alice", "bob"], ["carol"]
RATE, DELAY = "50mbit", 0.02  # the job's links: 50 Mbit/s each way, +40 ms round trip

# A TCP server that answers each byte it receives with that byte, then (on b"d") sends
# SIZE bytes; and a client that measures the echo's round trip and the download's rate.
_SERVER = """
import socket, sys
size = int(sys.argv[1])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9000)); s.listen()
while True:
    c, addr = s.accept()
    with c:
        while (b := c.recv(1)):
            if b == b"a":
                c.sendall(addr[0].encode().ljust(16))
            elif b == b"d":
                c.sendall(bytes(size)); break
            else:
                c.sendall(b)
"""
_CLIENT = """
import json, socket, sys, time
c = socket.create_connection((sys.argv[1], 9000), timeout=10)
c.sendall(b"a"); seen = c.recv(16).decode().strip()
t = time.monotonic(); c.sendall(b"e"); c.recv(1); rtt = time.monotonic() - t
t = time.monotonic(); c.sendall(b"d"); got = 0
while (chunk := c.recv(1 << 16)):
    got += len(chunk)
print(json.dumps({"seen": seen, "rtt": rtt, "bytes": got, "seconds": time.monotonic() - t}))
"""
_DOWNLOAD = 2_500_000  # 1 s at 20 Mbit/s


def _probe(lab: Lab, name: str) -> dict:
    return json.loads(lab.hosts[name].run([sys.executable, "-c", _CLIENT, RELAY_ADDR], timeout=30).stdout)


def _connect(lab: Lab, source: str, target: str, port: int) -> str:
    """'ok', or why a TCP connect from ``source`` to ``target`` failed (2 s bound)."""
    code = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)"
            "\n print('ok')\nexcept OSError as e:\n print(type(e).__name__, e)")
    return lab.hosts[source].run([sys.executable, "-c", code, target, str(port)], timeout=20).stdout.strip()


@pytest.fixture(scope="module")
def lab():
    with Lab(nat=NAT, proxied=PROXIED, keep=bool(os.environ.get("TTPEER_NETLAB_KEEP"))) as lab:
        lab.popen(lab.relay, [sys.executable, "-c", _SERVER, str(_DOWNLOAD)], "probe-server")
        lab.wait_port(lab.relay.ns, "0.0.0.0", 9000, "the probe server")
        yield lab
    assert not [ns for ns in lab_namespaces() if ns.startswith(lab.tag + "-")]
    assert all(p.poll() is not None for p in lab.procs)


@pytest.fixture(scope="module")
def pool(lab):
    for name in [*NAT, *PROXIED]:
        lab.shape(name, RATE, DELAY)
    url, fp = start_relay(lab)
    # Slowed batches (3x) make a shard last long enough to cut a peer in the middle of one.
    return start_pool(lab, url, fp, "alice", ["bob", "carol"], extra=("--slowdown", "2"))


def _job(home: Path, job_id: str) -> dict | None:
    return next((j for j in status(home)["jobs"] if j["id"] == job_id), None)


def _submit(homes: dict[str, Path], spec: dict) -> str:
    return call(homes["alice"] / "control.sock", {"op": "submit", "spec": spec, "task_file": None},
                timeout=120)["job"]


def _all_done(homes: dict[str, Path], job: str) -> bool:
    return job_finished(homes.values(), job)  # done, and the final files written: ready to export


def _exports(lab: Lab, homes: dict[str, Path], job: str) -> dict[str, str]:
    out = lab.dir / "exports"
    out.mkdir(exist_ok=True)
    return {n: ttpeer("export", job, str(out / f"{n}-{job[:8]}.safetensors"), "--home", str(h))[-1]
            for n, h in homes.items()}


def test_nat_routers_and_the_proxy_host_isolate_the_peers(lab):
    # A NATed peer reaches the relay, which sees the router's public address.
    assert _probe(lab, "alice")["seen"] == lab.hosts["alice"].public != lab.hosts["alice"].addr
    # Nothing starts a connection towards a peer: no route to its private address, and
    # the router drops inbound NEW connections (a timeout, not a refusal).
    assert "unreachable" in _connect(lab, "relay", lab.hosts["alice"].addr, 9000)
    assert _connect(lab, "relay", lab.hosts["alice"].public, 22).startswith("TimeoutError")
    assert _connect(lab, "bob", lab.hosts["alice"].public, 22).startswith("TimeoutError")
    # The proxied peer has no way out but its proxy.
    assert "unreachable" in _connect(lab, "carol", RELAY_ADDR, 9000)
    assert _connect(lab, "carol", lab.hosts["carol"].env["HTTPS_PROXY"].split("//")[1].split(":")[0], 8888) == "ok"


def test_shape_sets_rate_and_delay_and_unshape_lifts_them(lab):
    lab.shape("bob", "20mbit", 0.05)
    try:
        slow = _probe(lab, "bob")
    finally:
        lab.shape("bob", None, 0.0)
    fast = _probe(lab, "bob")
    assert slow["bytes"] == fast["bytes"] == _DOWNLOAD
    mbit = slow["bytes"] * 8 / slow["seconds"] / 1e6
    assert 12 < mbit < 21, slow  # tbf's 20 Mbit/s, less TCP's ramp-up
    assert 0.1 <= slow["rtt"] < 0.3, slow  # 2 x 50 ms
    assert fast["rtt"] < 0.05 and fast["bytes"] * 8 / fast["seconds"] / 1e6 > 100, fast
    assert slow["seen"] == fast["seen"] == lab.hosts["bob"].public  # the forwarder keeps the NAT


def test_join_works_behind_nat_and_through_the_proxy(lab, pool):
    for name, home in pool.items():
        st = status(home)
        assert st["relay"]["connected"] and st["relay"]["last_error"] is None, (name, st["relay"])
        assert sorted(p["name"] for p in st["peers"]) == sorted(pool), name
    # The relay saw only the routers' and the proxy host's public addresses.
    out = lab.relay.run(["ss", "-Htn", "state", "established", f"( sport = :{8443} )"]).stdout
    sources = {line.split()[-1].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()}
    assert sources == {lab.hosts[n].public for n in pool}, out
    assert f"CONNECT {RELAY_ADDR}:8443" in lab.log("tinyproxy-carol")  # carol went through her proxy


def test_fused_job_across_the_lab_exports_identical_models(lab, pool):
    spec = {**job_spec(rounds=3), "batches": 30, "lease": 10.0}
    job = _submit(pool, spec)
    wait_for(lambda: _all_done(pool, job), 240, "the job to finish on every peer", poll=0.25)
    hashes = _exports(lab, pool, job)
    assert len(set(hashes.values())) == 1 and len(hashes["alice"]) == 64, hashes
    final = _job(pool["carol"], job)
    assert final["round"] == 3 and final["eval_metric"] > 0.3  # it trained: mnist1d starts near 0.1


def test_a_peer_cut_off_for_30s_loses_nothing_and_the_job_completes(lab, pool):
    spec = {**job_spec(rounds=6), "batches": 30, "lease": 5.0}
    job = _submit(pool, spec)

    def bob_busy() -> bool:
        j = _job(pool["bob"], job)
        return j is not None and j["round"] >= 1 and j["training_shard"] is not None

    wait_for(bob_busy, 120, "bob to be training a shard", poll=0.05)
    cut_round = _job(pool["alice"], job)["round"]
    lab.cut("bob")
    cut_at = time.monotonic()
    try:
        # While bob is away, the others carry on: his lease runs out and they take over.
        wait_for(lambda: _job(pool["alice"], job)["round"] > cut_round + 1, 28, "alice's rounds to go on without bob")
        assert _job(pool["bob"], job)["round"] <= cut_round + 1  # he is really cut off
        time.sleep(max(0.0, 30 - (time.monotonic() - cut_at)))  # the cut's required length, not a wait
    finally:
        lab.restore("bob")
    wait_for(lambda: _all_done(pool, job), 180, "the job to finish on every peer after the cut", poll=0.25)
    # If bob closed rounds alone before he noticed the cut, two branches exist now; the
    # canonical chain is a pure function of the records, and a peer that finished on the
    # losing branch repairs (docs/ARCHITECTURE.md). Give that a bounded time.
    finals = lambda: {n: _job(h, job)["state_hash"] for n, h in pool.items()}  # noqa: E731
    # A repaired peer's status says "done" again only once it rewrote its final files for the
    # winning state (until then "finishing", and an export would copy the losing one).
    with contextlib.suppress(TtpeerError):
        wait_for(lambda: len(set(finals().values())) == 1 and _all_done(pool, job), 60,
                 "the peers to agree on the final state and write it")
    histories = {n: [row["state"] for row in _job(h, job)["history"]] + [_job(h, job)["state_hash"]]
                 for n, h in pool.items()}
    assert len(histories["bob"]) == 7 and all(h == histories["bob"] for h in histories.values()), histories
    hashes = _exports(lab, pool, job)
    assert len(set(hashes.values())) == 1, hashes
    assert audit_home(pool["bob"])["records"] > 0  # every record bob holds is whole and verifies
    assert status(pool["bob"])["relay"]["connected"]
    print({n: [(p["name"], p["contributions"]) for p in _job(h, job)["peers"]] for n, h in pool.items()})


def test_a_failing_lab_removes_its_namespaces_and_processes():
    with pytest.raises(RuntimeError, match="on purpose"):
        with Lab(nat=["x"], proxied=["y"]) as failing:
            sleeper = failing.popen(failing.hosts["x"], ["sleep", "300"], "sleeper")
            assert len(failing.namespaces) == 6 and set(failing.namespaces) <= set(lab_namespaces())
            raise RuntimeError("on purpose")
    assert sleeper.poll() is not None
    assert not [ns for ns in lab_namespaces() if ns.startswith(failing.tag + "-")]
    assert not failing.dir.exists()


def test_down_removes_the_leftovers_of_a_dead_lab_only():
    gone = subprocess.Popen(["true"])
    gone.wait()
    leftover, live = f"{PREFIX}{gone.pid}-0-wan", f"{PREFIX}{os.getpid()}-99-wan"
    for ns in (leftover, live):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    stray = subprocess.Popen(["ip", "netns", "exec", leftover, "sleep", "300"])
    try:
        wait_for(lambda: subprocess.run(["ip", "netns", "pids", leftover], capture_output=True,
                                        text=True).stdout.strip(), 10, "the stray process to start")
        # Scoped to this test's names: a real run of `down` also clears other dead labs.
        assert down(prefix=f"{PREFIX}{gone.pid}-") == [leftover]
        assert down(prefix=f"{PREFIX}{os.getpid()}-99-") == [] and live in lab_namespaces()
        assert stray.wait(timeout=10) != 0 and leftover not in lab_namespaces()
    finally:
        stray.kill()
        for ns in (leftover, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_a_bad_rate_is_a_clear_error(lab):
    with pytest.raises(LabError, match="rate must look like"):
        lab.shape("alice", "fast")
