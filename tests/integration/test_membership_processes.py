"""Memberships that end, and names, with real processes on loopback (a relay over TLS,
`ttpeer` daemons, the command line):

- ``invite --uses 1`` and two machines joining with it: the one that loses the race
  (lowest join id wins) is told, its daemon exits 3 with the message, and ``status``
  and ``up`` on its home say why at once.
- Both chose the admin's name: the winner gets a suffixed, pool-unique name.
- ``revoke`` on a member says it is admin-only before looking at names; on the admin it
  returns within 5 s and the revoked daemon exits within 10 s; its home then says
  "revoked", not "start it with 'ttpeer up'".
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import time
from pathlib import Path

import pytest

from ttpeer_harness import Cluster, make_pool, status, ttpeer, wait_for

pytestmark = pytest.mark.slow

LOST = "this token enrolled another machine first; ask the admin for a new one"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The command line, run in this process (an interpreter start each would double the
    test's time): its exit code and what it printed."""
    from ttpeer.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _exited(proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the daemon still runs {timeout:.0f} s later") from None


def test_token_race_names_and_revocation(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        (alice,) = make_pool(cluster, url, fp, ["alice"])
        token = ttpeer("invite", "--uses", "1", "--home", str(alice))[-1]
        # Two machines use the one-use token; both keep the hostname-like default "alice".
        homes = {who: tmp_path / who for who in ("sam", "tom")}
        cluster.spawn("sam", "join", token, "--name", "alice", "--home", str(homes["sam"]))
        wait_for(lambda: status(homes["sam"])["node"]["has_pool_key"], 60, "sam to get the pool key")
        cluster.spawn("tom", "join", token, "--name", "alice", "--home", str(homes["tom"]))

        def ended() -> str | None:
            return next((w for w in homes if cluster.named[w].poll() is not None), None)

        loser = wait_for(ended, 30, "the race's loser to stop")
        winner = "tom" if loser == "sam" else "sam"
        # Told at once, and for good: exit 3, which the systemd unit does not restart.
        assert _exited(cluster.named[loser], 5) == 3
        assert LOST in (tmp_path / f"{loser}.log").read_text()
        st = _cli("status", "--home", str(homes[loser]))
        assert st.returncode == 3 and LOST in st.stderr and "ttpeer up" not in st.stderr
        started = time.monotonic()
        up = _cli("up", "--home", str(homes[loser]))
        assert up.returncode == 3 and LOST in up.stderr and time.monotonic() - started < 10

        # The winner is a member under a name no one else in the pool has.
        def named() -> dict[str, str] | None:
            peers = {p["id"]: p["name"] for p in status(alice)["peers"]}
            return peers if len(peers) == 2 else None

        peers = named() or wait_for(named, 30, "the admin to list the winner")
        # The winner names itself once it holds the admin's join (gossip, a moment after it got the key).
        me = wait_for(lambda: (n := status(homes[winner])["node"])["name"] != "alice" and n, 30,
                      "the winner to learn the admin keeps the name")
        assert peers[me["id"]] == f"alice-{me['id'][:6]}" == me["name"]
        assert sorted(peers.values()) == ["alice", me["name"]]

        # A member may not revoke, and is told so before any name is matched.
        refused = _cli("revoke", "alice", "--home", str(homes[winner]))
        assert refused.returncode == 1 and "only the pool admin" in refused.stderr
        started = time.monotonic()
        done = _cli("revoke", me["name"], "--home", str(alice))
        took = time.monotonic() - started
        assert done.returncode == 0, done.stderr
        assert took < 5, f"revoke took {took:.1f} s"
        assert _exited(cluster.named[winner], 10) == 3
        assert "revoked" in (tmp_path / f"{winner}.log").read_text()
        st = _cli("status", "--home", str(homes[winner]))
        assert st.returncode == 3 and "revoked" in st.stderr and "ttpeer up" not in st.stderr
        started = time.monotonic()
        up = _cli("up", "--home", str(homes[winner]))
        assert up.returncode == 3 and "revoked" in up.stderr and time.monotonic() - started < 10
    finally:
        cluster.close()
