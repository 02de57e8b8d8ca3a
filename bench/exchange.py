"""``scripts/bench/exchange``: what each peer of a fused job sends and receives, against
what it must (issue 15, "no model sent twice").

A relay and N peers as processes on loopback (``ttpeer_harness``) train one fused job of a
charlm on the CPU, one inner step a shard, so the run is all exchange. Per peer, from
``ttpeer status --json`` and the records log: the bytes it sent and received for the job,
the bytes of its own deltas (its ``contrib`` records), and the initial state (the job's
``init_blob`` on the relay's disk). Prints, per peer:

- sent / (its deltas, and on the slices path the slices it reduced, + the initial state
  if it submitted): target <= 1.1x;
- received / (the other peers' deltas that closes used + the initial state unless it
  submitted): on the all-deltas path what a peer must download (every delta of the others),
  so about 1.0x; on the slices path (``--slices``) its slice of each other delta and the
  reduced slices, about one delta and one model a round whatever N.

One run per N in ``--peers`` (default 2,4) and path in ``--paths`` (both, side by side).
Compute is not emulated: the charlm's steps are short, and what is measured is bytes, which
do not depend on the machine's speed; the round times are loopback's, not a rate-limited
link's (no netem here).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ttpeer_harness import make_pool, status, temporary_cluster, ttpeer, wait_for

TASK = "charlm:n_layer=4,d_model=256,n_head=4,block_size=64"
TARGET_SENT = 1.1


def run_one(task: str, peers: int, rounds: int, shards: int, timeout: float, direct: str = "off",
            chunk: int | None = None) -> dict[str, Any]:
    from ttpeer.daemon._integrity import scan_log
    from ttpeer.proto import parse

    with temporary_cluster() as cluster:
        url, fp = cluster.start_relay()
        homes = make_pool(cluster, url, fp, [f"peer{i}" for i in range(peers)], extra=("--direct", direct))
        began = time.monotonic()
        job = ttpeer("submit", "--home", str(homes[0]), "--task", task, "--rounds", str(rounds),
                     "--inner-steps", "1", "--shards", str(shards), "--batch-size", "2", "--no-overlap",
                     *(("--slices", str(chunk)) if chunk else ()))[-1]

        def done() -> bool:
            jobs = [j for h in homes for j in status(h)["jobs"] if j["id"] == job]
            return len(jobs) == peers and all(j["state"] in ("done", "failed") for j in jobs)

        wait_for(done, timeout, f"the {peers}-peer job to finish", poll=0.5)
        wall = time.monotonic() - began
        time.sleep(2.0)  # an upload that follows the last close (there should be none)
        records = [parse(raw) for raw in scan_log((homes[0] / "records.log").read_bytes()).frames]
        [rec] = [r for r in records if r.kind == "job" and r.id == job]
        relay_blobs = {p.name: p.stat().st_size for p in Path(cluster.root / "relay").rglob("*")
                       if p.parent.name == "blobs"}
        init = relay_blobs.get(rec["init_blob"], 0)
        contribs = [r for r in records if r.kind == "contrib" and r["job"] == job]
        closes = [r for r in records if r.kind == "close" and r["job"] == job]
        slices = [r for r in records if r.kind == "slice" and r["job"] == job]
        uploader: dict[str, str] = {}
        for r in slices:  # the first record naming a blob is its uploader's (the log's order)
            uploader.setdefault(r["blob"], r.id)
        closed = {c for r in closes for c in r["contribs"]}
        ckpts = [r for r in records if r.kind == "ckpt" and r["job"] == job]
        rows = []
        for i, home in enumerate(homes):
            st = status(home)
            me = st["node"]["id"]
            j = next(j for j in st["jobs"] if j["id"] == job)
            # On the slices path a peer also uploads the slices it reduced (a check that
            # reproduced another's names that one's blob: nothing uploaded).
            own = sum(c["size"] for c in contribs if c.author == me) + sum(
                r["size"] for r in slices if r.author == me and uploader.get(r["blob"]) == r.id)
            others = sum(c["size"] for c in contribs if c.author != me and c.id in closed)  # what closes use
            must_send = own + (init if i == 0 else 0)
            must_get = others + (0 if i == 0 else init)
            rows.append({"peer": home.name, "sent": j["bytes_sent"], "received": j["bytes_received"],
                         "direct": (st.get("direct") or {}).get("fetched_blob_bytes", 0),
                         "own_deltas": own, "others_deltas": others, "must_send": must_send, "must_get": must_get,
                         "sent_ratio": j["bytes_sent"] / must_send if must_send else None,
                         "received_ratio": j["bytes_received"] / must_get if must_get else None})
        return {"peers": peers, "rounds": rounds, "shards": shards, "init": init, "checkpoints": len(ckpts),
                "path": "slices" if chunk else "all deltas",
                "sliced_rounds": sum(1 for c in closes if "slices" in c.body),
                "wall_s": round(wall, 1), "rows": rows, "direct": direct,
                "relay_egress": sum(r["received"] for r in rows), "direct_bytes": sum(r["direct"] for r in rows)}


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def table(result: dict[str, Any]) -> list[str]:
    out = [f"N = {result['peers']}, {result['path']} ({result['sliced_rounds']} rounds sliced), --direct "
           f"{result['direct']}: {result['rounds']} rounds x {result['shards']} "
           f"shards, initial state {_mb(result['init'])}, checkpoints published: {result['checkpoints']}, "
           f"{result['wall_s']} s", "", "| peer | sent | its deltas (+ init) | sent / that | received from the relay "
           "| directly | others' deltas (+ init) | received / that |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        sent = "-" if r["sent_ratio"] is None else f"{r['sent_ratio']:.2f}x"
        got = "-" if r["received_ratio"] is None else f"{r['received_ratio']:.2f}x"
        out.append(f"| {r['peer']} | {_mb(r['sent'])} | {_mb(r['must_send'])} | {sent} | {_mb(r['received'])} | "
                   f"{_mb(r['direct'])} | {_mb(r['must_get'])} | {got} |")
    return out


def summary(results: list[dict[str, Any]]) -> list[str]:
    """Per round, side by side: relay egress and what a peer receives (the initial state left
    out: it is sent once, whatever the path), against the smallest N of the same path and
    ``--direct``."""
    out = ["| N | path | --direct | relay egress / round | vs smallest N | a peer receives / round (relay + "
           "direct) | vs smallest N | of it directly | s / round |", "|---|---|---|---|---|---|---|---|---|"]
    first: dict[tuple[str, str], dict[str, float]] = {}
    for r in results:
        rounds, n = r["rounds"], r["peers"]
        got = r["relay_egress"] + r["direct_bytes"] - r["init"] * (n - 1)
        egress = (r["relay_egress"] - r["init"] * (n - 1)) / rounds
        per_peer = got / rounds / n
        base = first.setdefault((r["path"], r["direct"]), {"egress": egress, "per_peer": per_peer})
        share = r["direct_bytes"] / got if got else 0.0
        out.append(f"| {n} | {r['path']} | {r['direct']} | {_mb(egress)} | {egress / base['egress']:.2f}x | "
                   f"{_mb(per_peer)} | {per_peer / base['per_peer']:.2f}x | {share:.0%} | "
                   f"{r['wall_s'] / rounds:.1f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench/exchange", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default=TASK, help=f"a built-in task (default {TASK})")
    p.add_argument("--peers", default="2,4", help="peer counts, one run each (default 2,4)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shards", type=int, default=0, help="shards a round (default: 2 per peer)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--direct", default="off",
                   help="the LAN shortcut for each N: off, auto, or both side by side as off,auto (default off: "
                        "everything through the relay, the path every pool has)")
    p.add_argument("--paths", default="deltas,slices",
                   help="the exchange for each N: deltas (every peer downloads every delta), slices "
                        "(aggregation slices, --slices on the job), or both side by side (default deltas,slices)")
    p.add_argument("--chunk", type=int, default=65536, help="values per chunk on the slices path (default 65536)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    results, missed = [], []
    modes = args.direct.split(",")
    if not all(m in ("off", "auto") for m in modes):
        p.error("--direct takes off, auto, or off,auto")
    paths = args.paths.split(",")
    if not all(m in ("deltas", "slices") for m in paths):
        p.error("--paths takes deltas, slices, or deltas,slices")
    for n, mode, path in ((int(x), m, q) for x in args.peers.split(",") for m in modes for q in paths):
        result = run_one(args.task, n, args.rounds, args.shards or 2 * n, args.timeout, mode,
                         args.chunk if path == "slices" else None)
        results.append(result)
        print("\n".join(table(result)) + "\n", flush=True)
        for r in result["rows"]:
            if r["sent_ratio"] is not None and r["sent_ratio"] > TARGET_SENT:
                missed.append(f"N={n} {r['peer']}: sent {r['sent_ratio']:.2f}x its deltas (+ init)")
        if result["checkpoints"]:
            missed.append(f"N={n}: {result['checkpoints']} checkpoints published that nobody asked for")
    print("\n".join(summary(results)) + "\n")
    for line in missed or [f"every peer sent <= {TARGET_SENT}x its deltas (+ the initial state it submitted): PASS"]:
        print(("- MISS: " if missed else "- ") + line)
    if args.json:
        args.json.write_text(json.dumps({"task": args.task, "results": results}, indent=2))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
