"""The LAN shortcut across the network lab (issue 15 point 4): x and y are routed peers
that reach each other at their own addresses (one network, as two machines on a LAN or
with public addresses); n sits behind NAT. x adds a dataset; y fetches all of it from x
directly, none of it through the relay; n cannot reach x (nor x n) and fetches it through
the relay, as before. The job trains to identical exports on all three, and its initial
state and deltas go between x and y directly too, while n's go through the relay. Root only, like the
rest of ``tests/netns``."""

from __future__ import annotations

import os
import random
import textwrap

import pytest

from tests.integration._helpers import job_finished
from tests.integration.test_direct_processes import TASK
from ttpeer.daemon.service._integrity import scan_log
from ttpeer.proto import parse
from ttpeer_harness import status, ttpeer, wait_for
from ttpeer_harness.netlab import Lab, home_of, start_pool, start_relay, unavailable

WHY_NOT = unavailable()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

PIECE = 4096


def _row(home, name: str) -> dict:
    import json

    listing = json.loads("\n".join(ttpeer("data", "ls", "--json", "--home", str(home))))
    return next(d for d in listing["datasets"] if d["name"] == name)


def test_the_pair_that_reach_each_other_fetch_directly_and_the_nat_peer_through_the_relay():
    with Lab(nat=["n"], routed=["x", "y"], keep=bool(os.environ.get("TTPEER_NETLAB_KEEP"))) as lab:
        url, fp = start_relay(lab)
        homes = start_pool(lab, url, fp, "x", ["y", "n"])
        wait_for(lambda: all((status(homes[h]).get("direct") or {}).get("members") == 2 for h in homes), 60,
                 "every peer to serve directly and know where the others do")
        for name, host in lab.hosts.items():
            if name in homes:  # each advertises the address it reaches the relay from: its own
                assert status(homes[name])["direct"]["addrs"][0].split(":")[0] == host.addr

        rng = random.Random(4)
        data = lab.dir / "corpus"
        (data / "sub").mkdir(parents=True)
        (data / "a.bin").write_bytes(rng.randbytes(5 * PIECE + 100))
        (data / "sub" / "b.bin").write_bytes(rng.randbytes(3 * PIECE))
        notes = lab.dir / "notes"
        notes.mkdir()
        (notes / "n.bin").write_bytes(rng.randbytes(3 * PIECE))
        for folder in (data, notes):
            ttpeer("data", "add", str(folder), "--name", folder.name, "--piece-size", "4K", "--home", str(homes["x"]))
        task = lab.dir / "two_task.py"
        task.write_text(textwrap.dedent(TASK))
        job = ttpeer("submit", "--task", str(task), "--rounds", "2", "--shards", "3", "--inner-steps", "30",
                     "--batch-size", "32", "--lease", "30s", "--home", str(homes["x"]))[-1]
        wait_for(lambda: job_finished(homes.values(), job), 240, "the three peers to finish the job", poll=0.5)
        exports = {ttpeer("export", job, str(home_of(lab, n) / "out.safetensors"), "--home", str(homes[n]))[-1]
                   for n in homes}
        assert len(exports) == 1

        for name, size in (("corpus", 8 * PIECE + 100), ("notes", 3 * PIECE)):
            y, n = _row(homes["y"], name), _row(homes["n"], name)
            assert y["here"] == n["here"] == "fetched" and y["fetched_bytes"] == n["fetched_bytes"] == size
            assert y["direct_bytes"] == size, y  # none of the pair's bytes crossed the relay
            assert n["direct_bytes"] == 0, n  # behind NAT: no change, all through the relay
        # x served y's copies (y's address is out of n's reach too: n asked nobody successfully).
        assert status(homes["x"])["direct"]["served_bytes"] == 8 * PIECE + 100 + 3 * PIECE

        # The job's blobs: y took every delta of x (and x's initial state) from x directly, and
        # x took y's from y; n, behind NAT, took everything through the relay.
        direct = {n: status(homes[n])["direct"] for n in homes}
        ids = {n: status(homes[n])["node"]["id"] for n in homes}
        records = [parse(raw) for raw in scan_log((homes["x"] / "records.log").read_bytes()).frames]
        sizes = {n: sum(r["size"] for r in records if r.kind == "contrib" and r["job"] == job and r.author == ids[n])
                 for n in homes}
        assert direct["y"]["fetched_blob_bytes"] > sizes["x"], (direct, sizes)
        assert direct["x"]["fetched_blob_bytes"] >= sizes["y"], (direct, sizes)
        assert direct["n"]["fetched_blob_bytes"] == direct["n"]["served_blobs"] == 0, direct
        assert (direct["x"]["served_blob_bytes"] + direct["y"]["served_blob_bytes"]
                == direct["x"]["fetched_blob_bytes"] + direct["y"]["fetched_blob_bytes"]), direct
