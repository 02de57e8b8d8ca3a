"""The overlap benchmark behind ``scripts/bench/overlap``: does an overlapped fused job
train as well as one whose rounds wait, at the outer momentum it would run with?

With overlap, round r trains on the base of round r-1 (its close is still on the way)
and the executor starts it from its own estimate of round r's base (``TorchExecutor``'s
eager start). That is a one-round-delayed outer step, and outer momentum makes a delay
matter: this measures the final eval loss of the same job with and without overlap for
each task and outer momentum asked, so the default can be chosen from figures.

The network plays no part in the loss (the protocol fixes which base each round trains
on, whatever the link), so the peers here are real ``TorchExecutor``s driven through the
rounds in the protocol's order, each peer on a fixed shard, with no relay: each run is
deterministic, and the comparison is the same on every machine. The time a real link
saves with overlap is ``scripts/bench/wan``'s and ``scripts/bench/speedup``'s to measure.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import trio

RELAY, FP = "https://relay.test.invalid", "sha256:" + "0" * 64


def job_spec(task: str, overlap: int, momentum: float, rounds: int, steps: int, batch: int, peers: int,
             lr: float) -> dict:
    return {"task": task, "mode": "fused", "rounds": rounds, "shards": peers, "batches": steps, "batch_size": batch,
            "inner_lr": lr, "weight_decay": 0.01, "outer_lr": 0.7, "outer_momentum": momentum, "bits": 8,
            "seed": 1, "lease": 30.0, "steal": False, "overlap": overlap}


async def final_loss(root: Path, spec: dict, task_file: bytes | None = None) -> float:
    """The eval loss after the job ``spec``, over ``spec["shards"]`` executors (one shard
    each), every close reproduced bit for bit by the others."""
    from ttpeer.daemon import Home
    from ttpeer.daemon._torch import TorchExecutor
    from ttpeer.proto import PublishDelta, Train, sign

    homes = [Home(root / f"peer{i}") for i in range(spec["shards"])]
    for home in homes:
        home.create_pool(RELAY, FP, home.path.name, time.time())
    execs = [TorchExecutor(home) for home in homes]
    fixed, init = await execs[0].new_job(spec, task_file)
    body = {**spec, **fixed, "init_blob": "0" * 64, "task_blob": "", "at": int(time.time())}
    job = sign("job", homes[0].config().pool, body, homes[0].node_key())
    for ex in execs:
        assert await ex.prepare(job, task_file) is None
        assert await ex.import_state(job, fixed["init"], init)
    overlap = spec.get("overlap", 0)
    states, loss = [fixed["init"]], float("nan")
    for rnd in range(spec["rounds"]):
        base = states[max(0, rnd - 1)] if overlap else states[rnd]  # as proto's train_base
        deltas = []
        for shard, ex in enumerate(execs):
            samples = await ex.train(Train(job, rnd, shard, 0, base, fresh=True), lambda: False)
            delta, _ = await ex.delta(PublishDelta(job, rnd, base, (shard,), samples))
            deltas.append((delta, samples))
        state, metrics = await execs[0].aggregate(job, states[rnd], deltas, rnd=rnd)
        for ex in execs[1:]:
            assert await ex.apply(job, states[rnd], deltas, state, rnd=rnd)
        states.append(state)
        loss = float(metrics["eval_loss"])
    return loss


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench/overlap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="mnist1d,charlm", help="comma-separated ttpeer tasks")
    ap.add_argument("--momentum", default="0.9,0.5", help="outer momentums to measure, comma-separated")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--inner-steps", type=int, default=25)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--inner-lr", type=float, default=1e-3, help="AdamW lr (default 1e-3, the job default)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    print(f"{args.peers} peers x {args.rounds} rounds x {args.inner_steps} inner steps x batch {args.batch_size}, "
          f"inner lr {args.inner_lr}, outer lr 0.7 (Nesterov), 8-bit deltas; final eval loss\n")
    print("| task | outer momentum | rounds that wait | overlapped | overlapped / waiting |")
    print("|---|---|---|---|---|")
    for task in args.tasks.split(","):
        for momentum in (float(m) for m in args.momentum.split(",")):
            losses = []
            for overlap in (0, 1):
                spec = job_spec(task, overlap, momentum, args.rounds, args.inner_steps, args.batch_size, args.peers,
                                args.inner_lr)
                with tempfile.TemporaryDirectory() as tmp:
                    loss = trio.run(final_loss, Path(tmp), spec)
                losses.append(loss)
            print(f"| {task} | {momentum:g} | {losses[0]:.4f} | {losses[1]:.4f} | {losses[1] / losses[0]:.3f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
