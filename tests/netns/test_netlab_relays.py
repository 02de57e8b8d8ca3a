"""A pool of two relays across the network lab (issue 15 point 3): alice and bob behind NAT
routers, carol behind an HTTP CONNECT proxy, two relays on the relay host. The admin adds
the second relay; mid-job the first one, where the blobs went, is SIGKILLed. Every peer
carries on through the second (carol through her proxy), and the job finishes with
identical exports on all three. Root only, like the rest of ``tests/netns``."""

from __future__ import annotations

import os

import pytest

from tests.integration._helpers import job_finished, job_of
from ttpeer.daemon import call
from ttpeer_harness import job_spec, status, ttpeer, wait_for
from ttpeer_harness.netlab import (
    SECOND_RELAY_PORT,
    Lab,
    _sh,
    home_of,
    start_pool,
    start_relay_process,
    ttpeer_cmd,
    unavailable,
)

WHY_NOT = unavailable()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]


def _states(home) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {r["url"]: r["state"] for r in status(home)["relays"]}


def test_killing_the_first_of_two_relays_mid_job_loses_nothing_behind_nat_and_a_proxy():
    with Lab(nat=["alice", "bob"], proxied=["carol"], keep=bool(os.environ.get("TTPEER_NETLAB_KEEP"))) as lab:
        first, url0, fp0 = start_relay_process(lab)
        _second, url1, fp1 = start_relay_process(lab, port=SECOND_RELAY_PORT, name="relay1")
        alice = home_of(lab, "alice")
        # The pool starts on the first relay with alice; she adds the second from her host
        # (the command checks the relay's certificate over her NAT), then invites the others.
        homes = start_pool(lab, url0, fp0, "alice", [])
        _sh(*lab.hosts["alice"].cmd(ttpeer_cmd("relay", "add", url1, "--fingerprint", fp1, "--home", str(alice))))
        wait_for(lambda: _states(alice) == {url0: "live", url1: "live"}, 30, "alice on both relays")
        token = ttpeer("invite", "--uses", "2", "--home", str(alice))[-1]
        for name in ("bob", "carol"):
            homes[name] = home_of(lab, name)
            lab.hosts[name].popen(ttpeer_cmd("join", token, "--name", name, "--home", str(homes[name])), name)

        def all_in() -> bool:
            return all((h / "control.sock").exists() and status(h)["node"]["has_pool_key"]
                       and len(status(h)["peers"]) == 3 and _states(h) == {url0: "live", url1: "live"}
                       for h in homes.values())

        wait_for(all_in, 90, "three peers on both relays")
        spec = {**job_spec(5), "batches": 30, "lease": 10.0}
        job = call(alice / "control.sock", {"op": "submit", "spec": spec, "task_file": None}, timeout=120)["job"]
        wait_for(lambda: all((j := job_of(h, job)) is not None and j["round"] >= 1 for h in homes.values()), 180,
                 "round 1 to start everywhere", poll=0.25)
        first.kill()  # SIGKILL: its mailboxes and blobs are gone
        first.wait()
        wait_for(lambda: job_finished(homes.values(), job), 300, "the job to finish through the second relay",
                 poll=0.5)
        for h in homes.values():
            assert _states(h) == {url0: "down", url1: "live"}, status(h)["relays"]
        out = lab.dir / "exports"
        out.mkdir()
        exports = {ttpeer("export", job, str(out / f"{n}.safetensors"), "--home", str(h))[-1]
                   for n, h in homes.items()}
        assert len(exports) == 1
