"""What the worker process costs: ``scripts/bench/workers``.

Three ways to train the same shards of the same job, alternated ``--runs`` times in
one run so that machine load hits them alike:

- bare: a plain torch loop in this process (the task's model, AdamW, the same
  clipping and batches as ttpeer's inner loop), timed around the steps alone;
- in-process: ttpeer's ``TorchExecutor`` in this process (the old daemon's path);
- worker: ttpeer's ``ProcessExecutor``, the shard trained in a worker process and
  driven over its channel (the daemon's path now), timed from the daemon's side.

It prints steps/s of each and the ratio worker / bare (target >= 0.97), and the
per-round cost of the process boundary: one round's executor calls (train a shard,
take its delta, aggregate it, apply it) through the worker minus the same calls in
process, in ms and as a share of the round.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from ttpeer.daemon import Home
from ttpeer.daemon.worker._procexec import ProcessExecutor
from ttpeer.daemon.worker._torch import TorchExecutor
from ttpeer.proto import JobSpec, PublishDelta, Train, sign

RELAY, FP = "https://relay.bench.invalid", "sha256:" + "0" * 64


def _spec(task: str, batches: int, batch: int) -> dict[str, Any]:
    return {"task": task, "mode": "fused", "rounds": 1000, "shards": 1, "batches": batches, "batch_size": batch,
            "inner_lr": 1e-3, "weight_decay": 0.01, "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8, "seed": 1,
            "lease": 60.0, "steal": False}


def bare_steps_per_s(home: Home, task_name: str, batches: int, batch: int, device: str) -> float:
    import torch
    from torch import nn

    from ttpeer import train
    from ttpeer.train._spec import fetch_batch  # the inner loop's own batch maker: same data path

    task = train.load_task(task_name, home.data_dir)
    torch.manual_seed(1)
    dev = torch.device(device)
    model = task.spec.model().to(dev)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    indices = train.shard_indices(task.n_train, 1, 0, 0, 1, batches, batch)
    model.train()
    began = time.perf_counter()
    for idx in indices:
        x, y = fetch_batch(task.train, idx)
        loss = task.spec.loss(model(x.to(dev)), y.to(dev))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return batches / (time.perf_counter() - began)


async def _round(executor: Any, home: Home, spec: dict[str, Any], rnd: int, state: dict[str, Any]
                 ) -> tuple[float, float]:
    """One round through ``executor``: (seconds in train, seconds for the whole round)."""
    job, base = state["job"], state["base"]
    began = time.perf_counter()
    samples = await executor.train(Train(job, rnd, 0, 0, base, fresh=True), lambda: False)
    trained = time.perf_counter() - began
    data, _metrics = await executor.delta(PublishDelta(job, rnd, base, (0,), samples))
    new, _m = await executor.aggregate(job, base, [(data, samples)], rnd=0)
    state["base"] = new
    return trained, time.perf_counter() - began


async def _prepared(executor: Any, home: Home, spec: dict[str, Any]) -> dict[str, Any]:
    fixed, init = await executor.new_job(spec, None)
    body = {**spec, **fixed, "init_blob": "0" * 64, "task_blob": "", "at": int(time.time())}
    job = JobSpec.of(sign("job", home.config().pool, body, home.node_key()))
    assert await executor.prepare(job, None) is None
    assert await executor.import_state(job, fixed["init"], init)
    return {"job": job, "base": fixed["init"]}


async def measure(task: str, batches: int, batch: int, runs: int, rounds: int, device: str
                  ) -> dict[str, list[float]]:
    root = Path(tempfile.mkdtemp(prefix="ttpeer-bench-workers-"))
    home = Home(root / "home")
    home.create_pool(RELAY, FP, "bench", time.time())
    spec = _spec(task, batches, batch)
    out: dict[str, list[float]] = {"bare": [], "inproc": [], "worker": [], "round_inproc": [], "round_worker": []}
    inproc = TorchExecutor(home, device=device)
    async with trio.open_nursery() as nursery:
        worker = ProcessExecutor(home, spare=False, device=device)
        await nursery.start(worker.run)
        states = {"inproc": await _prepared(inproc, home, spec), "worker": await _prepared(worker, home, spec)}
        for name, ex in (("inproc", inproc), ("worker", worker)):  # first rounds pay one-off costs
            await _round(ex, home, spec, 0, states[name])
        for run in range(runs):
            out["bare"].append(await trio.to_thread.run_sync(bare_steps_per_s, home, task, batches, batch, device))
            for name, ex in (("inproc", inproc), ("worker", worker)):
                for r in range(rounds):
                    trained, whole = await _round(ex, home, spec, 1 + run * rounds + r, states[name])
                    out[name].append(batches / trained)
                    out[f"round_{name}"].append(whole)
        nursery.cancel_scope.cancel()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench/workers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="charlm", help="a built-in task (default charlm: 137K parameters)")
    p.add_argument("--batches", type=int, default=60, help="steps per shard (default 60)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--runs", type=int, default=3, help="alternations of the three ways (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per way and run (default 2)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    args = p.parse_args(argv)
    out = trio.run(measure, args.task, args.batches, args.batch_size, args.runs, args.rounds, args.device)
    med = {k: statistics.median(v) for k, v in out.items()}
    print(f"task {args.task} on {args.device}, {args.batches} steps x batch {args.batch_size}, "
          f"{args.runs} runs x {args.rounds} rounds")
    print(f"{'way':<28}{'steps/s (median)':>18}{'vs bare':>10}")
    for key, label in (("bare", "bare torch loop"), ("inproc", "TorchExecutor, in process"),
                       ("worker", "worker process")):
        print(f"{label:<28}{med[key]:>18.1f}{med[key] / med['bare']:>9.3f}x")
    boundary = med["round_worker"] - med["round_inproc"]
    print(f"one round (train, delta, aggregate): in process {1000 * med['round_inproc']:.0f} ms, "
          f"through the worker {1000 * med['round_worker']:.0f} ms; the boundary costs {1000 * boundary:.0f} ms "
          f"= {100 * boundary / med['round_worker']:.1f}% of the round")
    target = med["worker"] / med["bare"]
    print(f"target worker / bare >= 0.97: {'met' if target >= 0.97 else 'MISSED'} ({target:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
