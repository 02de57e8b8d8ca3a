"""The straggler benchmark behind ``scripts/bench/straggler``.

Three ``ttpeer`` processes on loopback; carol's batches are slowed so she trains at
a third of the others' speed. Three jobs in one pool, one after the other:

1. stealing on (the default),
2. stealing off (``steal: false`` in the job), to show what a straggler costs,
3. stealing on, with bob SIGKILLed in the middle of a round.

For each: the mean round time, and the ideal (total work / total speed, from the
speeds the peers publish with their claims). Targets (issue 3): round time with
stealing <= 1.15x the ideal; after the kill, extra time <= the lease plus one
shard's time.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

from ttpeer.daemon import call
from ttpeer.demo import Cluster, job_spec, status, temporary_cluster, ttpeer, wait_for

SLOWDOWN = 2.0  # batches take 1 + 2 = 3x as long on the straggler


def _run(homes, spec, kill=None) -> dict:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    job = call(homes[0] / "control.sock", {"op": "submit", "spec": spec, "task_file": None}, timeout=120)["job"]
    closes: list[float] = []
    killed_at = None
    while True:
        jobs = [j for j in status(homes[0])["jobs"] if j["id"] == job]
        if jobs:
            while jobs[0]["round"] > len(closes):
                closes.append(time.monotonic())
            if kill and killed_at is None and jobs[0]["round"] >= kill[1] and jobs[0]["shards_done"] >= 1:
                os.killpg(kill[0].pid, signal.SIGKILL)
                killed_at = time.monotonic()
            if jobs[0]["state"] == "done":
                break
        if time.monotonic() - started > 900:
            raise SystemExit("benchmark job did not finish in 15 minutes")
        time.sleep(0.05)
    rates = [p["rate"] for p in status(homes[0])["peers"] if p["rate"]]
    rounds = [b - a for a, b in zip(closes, closes[1:], strict=False)]
    work = spec["shards"] * spec["batches"]
    return {
        "job": job, "total": time.monotonic() - started, "round": statistics.mean(rounds or [float("nan")]),
        "ideal": work / sum(rates) if rates else float("nan"), "rates": rates,
        "dup": next(j for j in status(homes[0])["jobs"] if j["id"] == job)["duplicate_fraction"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench/straggler", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    spec = {**job_spec(args.rounds), "shards": 12, "batches": 150, "lease": 6.0}
    with temporary_cluster(args.keep) as cluster:
        url, fp = cluster.start_relay()
        homes = _pool(cluster, url, fp)
        _run(homes, {**spec, "rounds": 2, "seed": 9})  # warm-up: task loading, first speed measurements
        steal = _run(homes, spec)
        no_steal = _run(homes, {**spec, "steal": False, "seed": 1})
        killed = _run(homes, {**spec, "seed": 2}, kill=(cluster.named["bob"], 2))
    shard_s = spec["batches"] / min(steal["rates"]) if steal["rates"] else float("nan")
    print(f"\n3 peers on loopback, carol {1 + SLOWDOWN:.0f}x slower; mnist1d, {args.rounds} rounds x "
          f"{spec['shards']} shards x {spec['batches']} steps, lease {spec['lease']:.0f}s "
          f"(speeds, batches/s: {', '.join(f'{r:.0f}' for r in steal['rates'])})\n")
    print("| run | mean round | ideal round | ratio | job time | duplicated work |")
    print("|---|---|---|---|---|---|")
    for name, r in (("stealing on", steal), ("stealing off", no_steal), ("stealing on, bob SIGKILLed", killed)):
        print(f"| {name} | {r['round']:.2f} s | {r['ideal']:.2f} s | {r['round'] / r['ideal']:.2f}x | "
              f"{r['total']:.1f} s | {(r['dup'] or 0):.1%} |")
    extra = killed["total"] - steal["total"]
    print(f"\nkill: +{extra:.1f} s over the same job without it; bound = lease {spec['lease']:.0f} s + "
          f"one straggler shard {shard_s:.1f} s = {spec['lease'] + shard_s:.1f} s")
    return 0


def _pool(cluster: Cluster, url: str, fp: str):  # type: ignore[no-untyped-def]
    names = ["alice", "bob", "carol"]
    homes = [cluster.root / n for n in names]
    token = ttpeer("pool", "create", "--relay", url, "--fingerprint", fp, "--name", "alice", "--uses", "2",
                   "--home", str(homes[0]))[-1]
    cluster.spawn("alice", "up", "--home", str(homes[0]))
    cluster.spawn("bob", "join", token, "--name", "bob", "--home", str(homes[1]))
    cluster.spawn("carol", "join", token, "--name", "carol", "--home", str(homes[2]), "--slowdown", str(SLOWDOWN))
    wait_for(lambda: all(status(h)["node"]["has_pool_key"] and len(status(h)["peers"]) == 3 for h in homes),
             60, "3 peers to enroll")
    return homes


if __name__ == "__main__":
    sys.exit(main())
