"""What a fused job sends and receives (issue 15, "no model sent twice"), on real processes:
a relay over real TLS and two daemons on loopback. The submitter uploads the initial state
once and never downloads it back; no checkpoint goes up when both peers keep up; each peer
downloads only the other's deltas (its own are kept from when it uploaded them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ttpeer.daemon import call
from ttpeer.daemon.service._integrity import scan_log
from ttpeer.proto import GOSSIP_TRAFFIC, parse
from ttpeer_harness import Cluster, job_spec, make_pool, status, ttpeer, wait_for

from ._helpers import job_finished, job_of

pytestmark = pytest.mark.slow


def test_the_initial_state_goes_up_once_and_each_peer_downloads_only_the_others_deltas(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        homes = make_pool(cluster, url, fp, ["alice", "bob"], extra=("--slowdown", "2", "--direct", "off"))
        alice, bob = homes
        # Enough shards and rounds that bob, who starts by fetching the initial state, trains too.
        spec = {**job_spec(4), "shards": 8, "batches": 30, "steal": False}
        job = call(alice / "control.sock", {"op": "submit", "spec": spec, "task_file": None}, timeout=120)["job"]
        wait_for(lambda: job_finished(homes, job), 180, "both peers to finish the job", poll=0.25)
        records = [parse(raw) for raw in scan_log((alice / "records.log").read_bytes()).frames]
        [rec] = [r for r in records if r.kind == "job" and r.id == job]
        blobs = {p.name: p.stat().st_size for p in Path(tmp_path / "relay").rglob("*") if p.parent.name == "blobs"}
        init = blobs[rec["init_blob"]]
        me = {h.name: status(h)["node"]["id"] for h in homes}
        contribs = [r for r in records if r.kind == "contrib" and r["job"] == job]
        sizes = {n: sum(c["size"] for c in contribs if c.author == me[n]) for n in me}
        assert sizes["alice"] and sizes["bob"], sizes  # both trained
        assert not [r for r in records if r.kind == "ckpt" and r["job"] == job]  # nobody asked for one
        got = {h.name: job_of(h, job)["bytes_received"] for h in homes}
        # Sealing adds a few bytes a blob; the others' deltas may be fetched again after a retry.
        assert sizes["bob"] <= got["alice"] < sizes["bob"] + init // 2, (got, sizes, init)  # not the init
        assert init + sizes["alice"] <= got["bob"] < init + sizes["alice"] + sizes["bob"], (got, sizes, init)
        exports = {ttpeer("export", job, str(h / "m.safetensors"), "--home", str(h))[-1] for h in homes}
        assert len(exports) == 1
    finally:
        cluster.close()


def _direct_authors(home: Path) -> int:
    """Members whose ``direct`` record (where they serve blobs) ``home`` holds."""
    frames = scan_log((home / "records.log").read_bytes()).frames
    return len({r.author for r in map(parse, frames) if r.kind == "direct"})


@pytest.mark.parametrize("direct", ["off", "auto"])
def test_a_sliced_job_fetches_its_slice_of_each_delta_by_range_over_real_tls(tmp_path, direct):
    # Four daemons and a real relay: rounds of three or more authors close from reduced
    # slices. An aggregator fetches the cut table, the head and its chunks of every other
    # delta (HTTP Range through the relay, or with the LAN shortcut from the delta's
    # uploader over TLS pinned to its record), then the others' reduced slices: about half
    # of what downloading every other delta costs at N = 4.
    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        names = ["alice", "bob", "carol", "dave"]
        homes = make_pool(cluster, url, fp, names, extra=("--slowdown", "2", "--direct", direct))
        if direct != "off":  # every peer knows where the others serve before the job starts
            wait_for(lambda: all(_direct_authors(h) == len(homes) for h in homes), 60,
                     "every peer to hold the others' direct records", poll=0.25)
        # slice_bits as submit names it (so slow links reduce last): 3-bit slices against 4-bit deltas
        spec = {**job_spec(4), "shards": 8, "batches": 30, "steal": False, "chunk": 4096, "slice_bits": 3}
        job = call(homes[0] / "control.sock", {"op": "submit", "spec": spec, "task_file": None}, timeout=120)["job"]
        wait_for(lambda: job_finished(homes, job), 180, "all four peers to finish the sliced job", poll=0.25)
        records = [parse(raw) for raw in scan_log((homes[0] / "records.log").read_bytes()).frames]
        [rec] = [r for r in records if r.kind == "job" and r.id == job]
        closes = [r for r in records if r.kind == "close" and r["job"] == job and "slices" in r.body]
        assert closes, "rounds of three or more authors are reduced in slices"
        blobs = {p.name: p.stat().st_size for p in Path(tmp_path / "relay").rglob("*") if p.parent.name == "blobs"}
        init = blobs[rec["init_blob"]]
        me = {h.name: status(h)["node"]["id"] for h in homes}
        contribs = [r for r in records if r.kind == "contrib" and r["job"] == job]
        for h in homes[1:]:
            others = sum(c["size"] for c in contribs if c.author != me[h.name])
            fetched = status(h).get("direct", {}).get("fetched_blob_bytes", 0)  # ranges and blobs, directly
            got = job_of(h, job)["bytes_received"] + fetched - init
            # All deltas would be >= others; whole deltas for the reductions, more again. Here:
            # a quarter of each other delta, the slices it did not make, and the checks.
            assert 0 < got < 0.9 * others, (h.name, got, others)
            if direct == "off":
                assert fetched == 0
            else:  # the ranges and the reduced slices came from their uploaders, not the relay
                assert fetched > 0.5 * got, (h.name, fetched, got)
        # Uploaders answered the ranges themselves: three (table, head, chunks) for each
        # other delta an aggregator reduced, at least one aggregator's worth a sliced round.
        ranges = sum(status(h)["direct"]["served_ranges"] for h in homes)
        assert (ranges == 0) if direct == "off" else (ranges >= 3 * 3 * len(closes)), (direct, ranges)
        # The control traffic, as status shows it: every peer took in digests and new records.
        for h in homes:
            gossip = status(h)["gossip"]
            assert set(gossip) == set(GOSSIP_TRAFFIC), gossip
            assert gossip["digests_in"] > 0 and gossip["records_in_new"] > 0, (h.name, gossip)
        exports = {ttpeer("export", job, str(h / "m.safetensors"), "--home", str(h))[-1] for h in homes}
        assert len(exports) == 1
    finally:
        cluster.close()
