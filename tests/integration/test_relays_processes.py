"""Several relays (issue 15 point 3) on real processes: two relays over real TLS and three
`ttpeer` daemons on loopback.

The admin adds a second relay (``ttpeer relay add``); the token it makes next names both,
each with its own pin. Mid-job the first relay, where every blob went, is SIGKILLed: the
peers carry on through the second, the blobs only the dead relay held are sent again by
their uploaders, and the job finishes with bit-identical exports on every peer."""

from __future__ import annotations

import pytest

from ttpeer.daemon import call
from ttpeer.errors import TtpeerError
from ttpeer_harness import Cluster, job_spec, status, ttpeer, wait_for

from ._helpers import job_finished, job_of

pytestmark = pytest.mark.slow


def _states(home) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {r["url"]: r["state"] for r in status(home)["relays"]}


def test_killing_one_of_two_relays_mid_job_loses_nothing(tmp_path, capsys):
    cluster = Cluster(tmp_path)
    try:
        url0, fp0 = cluster.start_relay("relay0")
        url1, fp1 = cluster.start_relay("relay1")
        alice = tmp_path / "alice"
        ttpeer("pool", "create", "--relay", url0, "--fingerprint", fp0, "--name", "alice", "--home", str(alice))
        cluster.spawn("alice", "up", "--home", str(alice))
        wait_for(lambda: status(alice)["node"]["has_pool_key"], 60, "alice to start")
        # A mistake first: the pin of the other relay. Nothing changes, and the error says why.
        with pytest.raises(TtpeerError):
            ttpeer("relay", "add", url1, "--fingerprint", fp0, "--home", str(alice))
        said = capsys.readouterr().err
        assert f"the relay at {url1} presents certificate {fp1}" in said and "nothing was changed" in said, said
        assert ttpeer("relay", "add", url1, "--fingerprint", fp1, "--home", str(alice))[0].startswith(f"added {url1}")
        wait_for(lambda: _states(alice) == {url0: "live", url1: "live"}, 30, "alice to use both relays")
        token = ttpeer("invite", "--uses", "2", "--home", str(alice))[-1]
        homes = [alice, tmp_path / "bob", tmp_path / "carol"]
        for home in homes[1:]:
            cluster.spawn(home.name, "join", token, "--name", home.name, "--home", str(home))

        def all_in() -> bool:
            return all(status(h)["node"]["has_pool_key"] and len(status(h)["peers"]) == 3
                       and _states(h) == {url0: "live", url1: "live"} for h in homes)

        wait_for(all_in, 60, "three peers on both relays")
        spec = {**job_spec(5), "batches": 30, "lease": 8.0}
        job = call(alice / "control.sock", {"op": "submit", "spec": spec, "task_file": None}, timeout=120)["job"]
        wait_for(lambda: all((j := job_of(h, job)) is not None and j["round"] >= 1 for h in homes), 120,
                 "round 1 to start everywhere", poll=0.2)
        cluster.named["relay0"].kill()  # SIGKILL: no goodbye, its blobs gone with it
        cluster.named["relay0"].wait()
        wait_for(lambda: job_finished(homes, job), 240, "the job to finish through the other relay", poll=0.25)
        for h in homes:
            relays = {r["url"]: r for r in status(h)["relays"]}
            assert relays[url0]["state"] == "down" and relays[url1]["state"] == "live", relays
            assert relays[url1]["primary"]
        exports = {ttpeer("export", job, str(h / "m.safetensors"), "--home", str(h))[-1] for h in homes}
        assert len(exports) == 1
    finally:
        cluster.close()
