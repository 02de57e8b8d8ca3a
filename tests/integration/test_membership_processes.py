"""Memberships that end, and names, with real processes on loopback (a relay over TLS,
`ttpeer` daemons, the command line):

- ``invite --uses 1`` and two machines joining with it: the first keeps its place (the
  admin acknowledged its join), whatever the join ids; the second is refused at once, its
  daemon exits 3 saying who used the token and when, and ``up`` on its home says so again.
- Both chose the admin's name: the winner gets a suffixed, pool-unique name.
- ``revoke`` on a member says it is admin-only before looking at names; on the admin it
  returns within 5 s and the revoked daemon exits within 10 s; its home then says
  "revoked", not "start it with 'ttpeer up'".
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import time
from pathlib import Path

import pytest

from ttpeer_harness import Cluster, make_pool, status, ttpeer, wait_for

pytestmark = pytest.mark.slow

USED = "this token was already used by "


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

        assert wait_for(ended, 30, "the second machine to stop") == "tom"
        loser, winner = "tom", "sam"
        # Told at once, and for good: exit 3, which the systemd unit does not restart.
        assert _exited(cluster.named[loser], 5) == 3
        said = (tmp_path / f"{loser}.log").read_text()
        sam_name = wait_for(lambda: next((p["name"] for p in status(alice)["peers"] if p["name"] != "alice"), None),
                            30, "the admin to list sam")
        assert f"{USED}{sam_name} at " in said, said
        st = _cli("status", "--home", str(homes[loser]))  # the relay's refusal carried the signed proof
        assert st.returncode == 3 and f"{USED}{sam_name} at " in st.stderr and "ttpeer up" not in st.stderr
        started = time.monotonic()
        up = _cli("up", "--home", str(homes[loser]))
        assert up.returncode == 3 and f"{USED}{sam_name} at " in up.stderr and time.monotonic() - started < 10
        assert cluster.named[winner].poll() is None  # the first machine runs on

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


def test_while_the_admin_is_away_a_token_race_waits_for_it(tmp_path: Path) -> None:
    """Both machines join with one single-use token while the admin is stopped: the lower
    join id holds the use provisionally (bob's status says so) and the other waits, not
    ended; the admin starts again, acknowledges the provisional member, and the other exits
    3 naming it. The acknowledged member runs on."""
    from ttpeer.proto import parse

    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        alice, bob = make_pool(cluster, url, fp, ["alice", "bob"])
        token = ttpeer("invite", "--uses", "1", "--home", str(alice))[-1]
        cluster.named["alice"].terminate()
        assert _exited(cluster.named["alice"], 30) == 0
        homes = {who: tmp_path / who for who in ("sam", "tom")}
        for who in homes:
            cluster.spawn(who, "join", token, "--name", who, "--home", str(homes[who]))
        joins = {who: wait_for(lambda w=who: (homes[w] / "pool.json").exists() and parse(
            bytes.fromhex(json.loads((homes[w] / "pool.json").read_text())["join"])).id, 60,
            f"{who} to enroll") for who in homes}
        held, waiting = sorted(homes, key=lambda w: joins[w])

        def provisional() -> bool:
            return any(p["name"] == held and p["provisional"] for p in status(bob)["peers"])

        wait_for(provisional, 60, f"bob to list {held} as provisional")
        said = _cli("status", "--home", str(bob)).stdout
        line = next(x for x in said.splitlines() if x.strip().startswith(held + " "))
        assert "provisional: the admin has not acknowledged its join yet" in line, said
        assert cluster.named[waiting].poll() is None  # not ended: no signed record says it lost

        cluster.spawn("alice", "up", "--home", str(alice))
        assert wait_for(lambda: cluster.named[waiting].poll() is not None, 60, f"{waiting} to stop") is True
        assert _exited(cluster.named[waiting], 5) == 3
        assert f"{USED}{held} at " in (tmp_path / f"{waiting}.log").read_text()
        wait_for(lambda: not any(p["provisional"] for p in status(bob)["peers"]), 30, "the acknowledgement")
        assert cluster.named[held].poll() is None
    finally:
        cluster.close()
