"""``scripts/bench/charlm``: the charlm task on a real pool, end to end.

A relay and peers as processes on loopback, the way a user runs them: the admin
submits with ``ttpeer submit --task charlm``; one more peer runs with a memory
limit too small for the model (``TTPEER_MEMORY_LIMIT``) and declines. Prints the
validation loss and perplexity per round, seconds per round, the corpus hash,
what ``ttpeer status`` says about the decline, and whether the training peers
ended on the same model.
"""

from __future__ import annotations

import argparse
import json
import time

from ttpeer_harness import Cluster, make_pool, status, temporary_cluster, ttpeer, wait_for


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="charlm", help="charlm or charlm:key=int,... (default charlm)")
    p.add_argument("--peers", type=int, default=2, help="peers that train (default 2)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--inner-steps", type=int, default=25)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--small-limit", default="8M",
                   help="memory limit of the peer that declines (default 8M: less than the default charlm needs "
                        "even in micro-batches of one sample)")
    args = p.parse_args()

    with temporary_cluster() as cluster:
        url, fp = cluster.start_relay()
        names = [f"peer{i}" for i in range(args.peers)] + ["small"]
        small = Cluster(cluster.root, env={"TTPEER_MEMORY_LIMIT": args.small_limit})
        try:
            plain = cluster.spawn
            cluster.spawn = lambda name, *rest: (small.spawn if name == "small" else plain)(name, *rest)  # type: ignore[method-assign]
            homes = make_pool(cluster, url, fp, names)
            began = time.monotonic()
            out = ttpeer("submit", "--home", str(homes[0]), "--task", args.task, "--rounds", str(args.rounds),
                         "--inner-steps", str(args.inner_steps), "--shards", str(args.shards))
            job = out[-1]
            rounds_at: dict[int, float] = {}

            def done() -> bool:
                jobs = [j for h in homes[:-1] for j in status(h)["jobs"] if j["id"] == job]
                if jobs:
                    rounds_at.setdefault(jobs[0]["round"], time.monotonic() - began)
                return len(jobs) == len(homes) - 1 and all(j["state"] == "done" for j in jobs)

            wait_for(done, 1800, "the charlm job to finish", poll=0.2)
            wall = time.monotonic() - began
            history = ttpeer("status", "--home", str(homes[0]))
            sidecars = []
            for h in homes[:-1]:
                ttpeer("export", job, str(h / "model.safetensors"), "--home", str(h))
                sidecars.append(json.loads((h / "model.json").read_text()))
            small_job = [j for j in status(homes[-1])["jobs"] if j["id"] == job][0]
            rows = [j for j in status(homes[0])["jobs"] if j["id"] == job][0]["history"]
        finally:
            small.close()

    first = sidecars[0]
    ev = first["metrics"]["eval"]
    print(f"task {args.task}: {first['param_count']} parameters, {args.peers} training peers + 1 too small, "
          f"{args.rounds} rounds x {args.shards} shards x {args.inner_steps} steps")
    print(f"corpus: python {first['task_info']['python']} stdlib, {first['task_info']['corpus_bytes']} bytes, "
          f"sha256 {first['task_info']['corpus_sha256']}")
    for row in rows:
        print(f"  round {row['round']}: val_loss {row['eval_loss']:.4f}, perplexity {row['eval_metric']:.3f}, "
              f"{row['contributions']} contributions")
    print(f"final: val_loss {ev['eval_loss']:.4f} nats/byte, perplexity {ev['perplexity']:.3f}")
    print(f"wall {wall:.1f} s from submit to done, {wall / args.rounds:.1f} s per round "
          f"(round reached at s: {dict(sorted(rounds_at.items()))})")
    print(f"same model on every training peer: {len({s['model_sha256'] for s in sidecars}) == 1}")
    print(f"small peer: {small_job['state']}: {small_job['declined']}")
    print("ttpeer status on peer0:")
    print("\n".join("  " + line for line in history))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
