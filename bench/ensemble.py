"""The ensemble benchmark behind ``scripts/bench/ensemble``.

The same ensemble job (mnist1d, 4 members, same seed, so the same members and
variants) runs twice on real ``ttpeer`` processes on loopback: on a pool of one
peer, then on a pool of two. Each pool first runs a small warm-up job so task data
is cached and speeds are known. Printed side by side: wall time from submit to
done on every peer, the ratio, each member's test accuracy and the vote's, and
whether both runs ended on the same ensemble state (they should: a unit is a pure
function of the member's checkpoint, whoever trains it).

Targets (issue 4): 4 members on 2 peers take <= 0.6x the wall time of 1 peer; the
ensemble's test accuracy is above its best member's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ttpeer.daemon import call
from ttpeer_harness import Cluster, make_pool, status, temporary_cluster, ttpeer, wait_for


def ensemble_spec(members: int, rounds: int, batches: int, seed: int = 0) -> dict[str, Any]:
    return {"task": "mnist1d", "mode": "ensemble", "members": members, "rounds": rounds, "shards": None,
            "batches": batches, "batch_size": 64, "inner_lr": 2e-3, "weight_decay": 0.01, "outer_lr": 0.7,
            "outer_momentum": 0.9, "bits": 8, "seed": seed, "lease": 20.0, "steal": True}


def run_ensemble(homes: list[Path], spec: dict[str, Any]) -> dict[str, Any]:
    """Submit ``spec`` on the first peer, wait until every peer is done; export the bundle."""
    load = os.getloadavg()[0]  # other work on the machine: two peers need two free cores to halve the time
    started = time.monotonic()
    job = call(homes[0] / "control.sock", {"op": "submit", "spec": spec, "task_file": None}, timeout=120)["job"]

    def done() -> bool:
        # "done" once each peer has written its final model (status says "finishing" before)
        return all(any(j["id"] == job and j["state"] == "done" for j in status(h)["jobs"]) for h in homes)

    wait_for(done, 1200, f"ensemble job {job[:12]} to finish on every peer", poll=0.1)
    wall = time.monotonic() - started
    out = homes[0] / "bundle.safetensors"
    digest = ttpeer("export", job, str(out), "--home", str(homes[0]))[-1]
    side = json.loads(out.with_suffix(".json").read_text())
    return {"job": job, "wall": wall, "sidecar": side, "sha256": digest, "bundle": out, "load": load}


def _stop(cluster: Cluster, names: list[str]) -> None:
    for name in names:
        proc = cluster.named[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench/ensemble", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="units per member (default 3)")
    ap.add_argument("--steps", type=int, default=1000, help="AdamW steps per unit (default 1000)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    spec = ensemble_spec(args.members, args.rounds, args.steps)
    warm = ensemble_spec(2, 1, 20, seed=99)
    with temporary_cluster(args.keep) as cluster:
        url, fp = cluster.start_relay()
        solo = make_pool(cluster, url, fp, ["solo"])
        run_ensemble(solo, warm)
        one = run_ensemble(solo, spec)
        _stop(cluster, ["solo"])  # idle daemons would only add noise to the next run
        pair = make_pool(cluster, url, fp, ["alice", "bob"])
        run_ensemble(pair, warm)
        two = run_ensemble(pair, spec)
        trained_by = _trainers(pair, two["job"])
    print_table(args, one, two, trained_by)
    return 0


def _trainers(homes: list[Path], job: str) -> dict[str, int]:
    """Units each peer published, read from the first peer's record log (read-only: the
    daemon may still append)."""
    import struct

    from ttpeer.proto import RecordError, parse

    names = {p["id"]: p["name"] for p in status(homes[0])["peers"]}
    data = (homes[0] / "records.log").read_bytes()
    counts: dict[str, int] = {}
    offset = 0
    while offset + 8 <= len(data):
        (size, _crc) = struct.unpack(">II", data[offset:offset + 8])
        raw, offset = data[offset + 8:offset + 8 + size], offset + 8 + size
        try:
            rec = parse(raw)
        except RecordError:
            continue
        if rec.kind == "contrib" and rec["job"] == job:
            name = names.get(rec.author, rec.author[:8])
            counts[name] = counts.get(name, 0) + 1
    return counts


def print_table(args: argparse.Namespace, one: dict[str, Any], two: dict[str, Any], trained_by: dict[str, int]) -> None:
    ratio = two["wall"] / one["wall"]
    side = two["sidecar"]
    metric = side["metric_name"]
    best = max(m[metric] for m in side["members"])
    vote = side["ensemble"][metric]
    print(f"\nmnist1d ensemble: {args.members} members x {args.rounds} units x {args.steps} steps "
          f"(batch 64), real processes on loopback, {os.cpu_count()} CPUs\n")
    print("| run | wall time | ratio to 1 peer | ensemble accuracy | best member | load average at start |")
    print("|---|---|---|---|---|---|")
    for label, r in (("1 peer", one), ("2 peers", two)):
        s = r["sidecar"]
        print(f"| {args.members} members on {label} | {r['wall']:.1f} s | {r['wall'] / one['wall']:.2f}x | "
              f"{s['ensemble'][metric]:.3f} | {max(m[metric] for m in s['members']):.3f} | {r['load']:.1f} |")
    print("\n| member | seed | lr | weight decay | steps | test accuracy |")
    print("|---|---|---|---|---|---|")
    for m in side["members"]:
        print(f"| {m['index']} | {m['seed']} | {m['lr']:g} | {m['weight_decay']:g} | {m['steps']} | {m[metric]:.3f} |")
    print(f"| ensemble (vote) | | | | | {vote:.3f} |")
    same = one["sidecar"]["state_hash"] == side["state_hash"]
    print(f"\nunits per peer (2-peer run): {', '.join(f'{k} {v}' for k, v in sorted(trained_by.items()))}")
    print(f"same final ensemble on 1 and 2 peers: {'yes' if same else 'NO'} ({side['state_hash'][:19]}...)")
    print(f"targets: wall ratio {ratio:.2f} <= 0.60: {'met' if ratio <= 0.6 else 'MISSED'}; "
          f"ensemble {vote:.3f} > best member {best:.3f}: {'met' if vote > best else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
