"""The convergence lab behind ``scripts/bench/convergence``: how many inner steps per peer
a fused job needs to reach an eval loss, against perfect data parallelism, with no network.

Every run is real ``TorchExecutor``s (one per peer, each with its home on disk) driven
through a job's rounds in the protocol's order, one shard per peer: each round every peer
trains its shard, publishes its delta (4-bit by default, as submitted), the first closes
the round and the others reproduce the close bit for bit. With overlap (what ``ttpeer
submit`` runs), round r trains from the peer's estimate of its base while round r-1's close
is on its way, and the close lands after ``sync`` inner steps of round r (the sync,
measured in steps: the link's part, which the lab leaves out, is that number); the
executor then corrects the local model onto it (``daemon/worker/_overlap.py``). The network plays
no other part in the loss, so the runs are deterministic: the same figures on any machine,
however loaded (CPU load changes only how long they take).

Against each, in the same run: the DP bound, the plain training loop at M x B (synchronous
data parallelism over M peers at batch B: the fewest steps M peers can need), and rounds
that wait. The eval loss is taken after every close; steps to a target are interpolated
between closes (``ttpeer._advise.steps_to``).

Variants are written ``NAME[:key=value,...]``: ``overlap`` and ``wait`` (what submit uses:
the pool's outer rule, ``proto/_outer.py``: the momentum by the pool's size, scaled by how far
the round before's deltas agreed; the table gives its ceiling), with ``mu=``, ``lr=`` for a
fixed outer step, ``agree=0`` for the rule by the pool's size alone, ``sync=`` for another
lag (``sync=none``: the close lands after the round, so no mid-round correction: the eager
start alone), ``h=`` for other rounds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ttpeer._parser import DEFAULT_BITS

RELAY, FP = "https://relay.test.invalid", "sha256:" + "0" * 64
WEIGHT_DECAY = 0.01


@dataclass(frozen=True)
class Variant:
    """One way of running the rounds. ``sync``: with overlap, the inner steps of round r
    trained before round r-1's close lands (None: after the round ends); ``outer``: a fixed
    (lr, momentum), None for the pool's rule; ``agree``: that rule's momentum scaled by the
    peers' agreement (``proto/_outer.py``), as submit runs it."""

    name: str
    overlap: bool
    h: int
    sync: int | None
    outer: tuple[float, float] | None = None
    agree: bool = True

    @property
    def default(self) -> bool:
        """What ``ttpeer submit`` runs (overlap, the pool's outer rule): the lab's headline rows."""
        return self.overlap and self.outer is None and self.agree and self.sync is not None

    def settings(self, peers: int, agreed: float | None = None) -> tuple[float, float]:
        """The outer step of a round closed from ``peers`` contributions, given how far the
        round before's deltas ``agreed`` (``proto._outer.signal``; None: none closed yet)."""
        from ttpeer.proto import outer_settings

        if self.outer is not None:
            return self.outer
        return tuple(outer_settings(peers, self.h, agreed, agree=self.agree))  # type: ignore[return-value]


def parse_variant(text: str, h: int, sync: int) -> Variant:
    """``overlap``, ``wait``, with options: ``wait:mu=0.5``, ``overlap:sync=none,h=50``,
    ``wait:agree=0`` (the pool's rule by its size alone). Raises ValueError with the forms it takes."""
    name, _, rest = text.partition(":")
    if name not in ("overlap", "wait"):
        raise ValueError(f"unknown variant {text!r}: overlap or wait, then options (overlap:mu=0.7,sync=8,h=50)")
    opts: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in ("mu", "lr", "sync", "h", "agree"):
            raise ValueError(f"bad option {item!r} in {text!r}: mu=, lr=, sync= (steps or none), h=, agree=0")
        opts[key] = value
    rounds = int(opts.get("h", h))
    lag = None if opts.get("sync") == "none" else int(opts.get("sync", sync if "h" not in opts else _lag(rounds)))
    outer = None
    if "mu" in opts or "lr" in opts:
        outer = (float(opts.get("lr", 0.7)), float(opts.get("mu", 0.9)))
    return Variant(text, name == "overlap", rounds, lag, outer, opts.get("agree", "1") != "0")


def _lag(h: int) -> int:
    """The latest a close can land when the pool sizes rounds to hide the sync: a round of
    ``h`` steps hides a sync of at most ``h / SYNC_MARGIN`` steps (``proto/_cadence.py``)."""
    from ttpeer.proto._cadence import SYNC_MARGIN

    return math.ceil(h / SYNC_MARGIN)


@dataclass(frozen=True)
class Case:
    task: str
    batch: int
    peers: int
    seed: int
    variant: Variant | None  # None: the DP bound (plain loop at peers x batch)
    lr: float
    bits: int
    steps: int  # most inner steps per peer
    target: float


def job_spec(case: Case) -> dict[str, Any]:
    v = case.variant
    assert v is not None
    lr, momentum = v.settings(case.peers)
    spec: dict[str, Any] = {
        "task": case.task, "mode": "fused", "rounds": max(1, case.steps // v.h), "shards": case.peers,
        "batches": v.h, "batch_size": case.batch, "inner_lr": case.lr, "weight_decay": WEIGHT_DECAY,
        "outer_lr": lr, "outer_momentum": momentum, "bits": case.bits, "seed": case.seed, "lease": 30.0,
        "steal": False, "overlap": int(v.overlap)}
    if v.outer is None:
        spec["outer_auto"] = 2 if v.agree else 1
    return spec


async def run_job(root: Path, case: Case, task_file: bytes | None = None) -> list[tuple[int, float]]:
    """(inner steps per peer, eval loss) after every close of ``case``'s job, until the
    target is first reached or the steps run out."""
    from ttpeer.daemon import Home
    from ttpeer.daemon.worker._torch import TorchExecutor
    from ttpeer.proto import JobSpec, Outer, PublishDelta, Train, sign
    from ttpeer.proto._outer import mean_kept, signal

    v = case.variant
    assert v is not None
    spec = job_spec(case)
    homes = [Home(root / f"peer{i}") for i in range(case.peers)]
    for home in homes:
        home.create_pool(RELAY, FP, home.path.name, time.time())
    execs = [TorchExecutor(home) for home in homes]
    fixed, init = await execs[0].new_job(spec, task_file)
    body = {**spec, **fixed, "init_blob": "0" * 64, "task_blob": "", "at": int(time.time())}
    job = JobSpec.of(sign("job", homes[0].config().pool, body, homes[0].node_key()))
    for ex in execs:
        if await ex.prepare(job, task_file) is not None or not await ex.import_state(job, fixed["init"], init):
            raise RuntimeError("an executor could not prepare the lab's job")
    states, curve = [fixed["init"]], []
    pending: list[tuple[bytes, int]] = []  # the deltas of the round whose close is on its way
    energies: list[tuple[int, object]] = []  # their (samples, delta_sq): the agreement's other half
    agreed: float | None = None  # how far the last close's deltas agreed, 0-1 (None: none yet)
    steps: dict[int, Outer | None] = {}  # each round's outer step, as its close names it

    async def close(i: int, of: int) -> None:
        """Peer ``i`` takes the close of round ``of``: the first aggregates, the others reproduce."""
        nonlocal agreed
        if i == 0:
            steps[of] = Outer(*v.settings(case.peers, agreed)) if v.outer is None else None
            state, metrics = await execs[0].aggregate(job, states[of], pending, rnd=of, outer=steps[of])
            states.append(state)
            curve.append(((of + 1) * v.h, float(metrics["eval_loss"])))
            kept = mean_kept(metrics.get("mean_sq"), energies)  # as the pool's ``proto.agreement``
            agreed = None if kept is None else signal(kept, len(pending), v.h)
        elif not await execs[i].apply(job, states[of], pending, states[of + 1], rnd=of, outer=steps[of]):
            raise RuntimeError(f"peer {i} did not reproduce the close of round {of}")

    def reached() -> bool:
        return bool(curve) and curve[-1][1] <= case.target

    for rnd in range(spec["rounds"]):
        late = v.overlap and rnd > 0  # round r-1's close is still on its way
        mid = late and v.sync is not None and v.sync < v.h
        base = states[rnd - 1] if late else states[rnd]
        trained = []
        for i, ex in enumerate(execs):
            hook = _landing(i, v.sync, functools.partial(close, of=rnd - 1)) if mid else (lambda: False)
            trained.append(await ex.train(Train(job, rnd, i, 0, base, fresh=True), hook))
        if late and not mid:  # it lands once the round has trained: nothing to correct
            for i in range(case.peers):
                await close(i, rnd - 1)
        if reached():
            return curve
        pending, energies = [], []
        for i, (ex, samples) in enumerate(zip(execs, trained, strict=True)):
            delta, figures = await ex.delta(PublishDelta(job, rnd, base, (i,), samples))
            pending.append((delta, samples))
            energies.append((samples, figures.get("delta_sq")))
        if not v.overlap:
            for i in range(case.peers):
                await close(i, rnd)
            if reached():
                return curve
    if v.overlap:  # the last round's close
        for i in range(case.peers):
            await close(i, spec["rounds"] - 1)
    return curve


def _landing(peer: int, at: int | None, close: Any) -> Any:
    """A ``should_stop`` for peer ``peer``'s shard that, before its ``at``-th batch, runs
    ``close(peer)`` (the close of the round before, in the trio loop, while the training
    thread waits): the executor then moves the local model onto it at that batch."""
    import trio

    count = 0

    def hook() -> bool:
        nonlocal count
        if count == at:
            trio.from_thread.run(close, peer)
        count += 1
        return False

    return hook


async def run_ensemble(root: Path, task: str, members: int, units: int, steps: int, batch: int, lr: float,
                       seed: int) -> dict[str, Any]:
    """An ensemble job of ``members`` members x ``units`` units of ``steps`` steps on one
    executor (a unit is a pure function of its member's checkpoint, so the peers that train
    it do not change the result), through ``finish``: the bundle's sidecar, and the test
    figures of the vote with every member counted once (the vote before selection)."""
    from ttpeer import train
    from ttpeer.daemon import Home
    from ttpeer.daemon.worker._torch import TorchExecutor
    from ttpeer.proto import JobSpec, PublishDelta, Train, member_variants, sign

    home = Home(root / "peer0")
    home.create_pool(RELAY, FP, "peer0", time.time())
    ex = TorchExecutor(home)
    spec = {"task": task, "mode": "ensemble", "rounds": units, "shards": members, "batches": steps,
            "batch_size": batch, "inner_lr": lr, "weight_decay": WEIGHT_DECAY, "outer_lr": 0.7, "outer_momentum": 0.9,
            "bits": 8, "seed": seed, "lease": 30.0, "steal": False,
            "members": member_variants(seed, members, lr, WEIGHT_DECAY)}
    fixed, init = await ex.new_job(spec, None)
    body = {**spec, **fixed, "init_blob": "0" * 64, "task_blob": "", "at": int(time.time())}
    job = JobSpec.of(sign("job", home.config().pool, body, home.node_key()))
    if await ex.prepare(job, None) is not None or not await ex.import_state(job, fixed["init"], init):
        raise RuntimeError("the executor could not prepare the lab's ensemble job")
    state, metrics = fixed["init"], {}
    for unit in range(units):
        ckpts = []
        for m in range(members):
            samples = await ex.train(Train(job, unit, m, 0, state, fresh=True), lambda: False)
            ckpts.append(((await ex.delta(PublishDelta(job, unit, state, (m,), samples)))[0], samples))
        state, metrics = await ex.aggregate(job, state, ckpts, rnd=unit)
    await ex.finish(job, state, {"weights": metrics.get("weights")})
    side = json.loads((home.states(job.id) / "final.json").read_text())
    ctx = ex._jobs[job.id]
    _members, uniform = train.evaluate_ensemble(ctx.task, ex._state(job, state))
    side["uniform"] = {"eval_loss": uniform[0], side["metric_name"]: uniform[1]}
    return side


def ensemble_row(task: str, members: int, units: int, steps: int, batch: int, lr: float,
                 seed: int) -> dict[str, Any]:
    """``run_ensemble`` in this process: the vote against its best member on the test set."""
    import torch
    import trio

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        side = trio.run(run_ensemble, Path(tmp), task, members, units, steps, batch, lr, seed)
    metric = side["metric_name"]
    lower = metric == "perplexity"  # charlm's: exp(loss), lower is better; accuracy: higher
    best_loss = min(m["eval_loss"] for m in side["members"])
    best_metric = (min if lower else max)(m[metric] for m in side["members"])
    vote = side["ensemble"]
    return {"task": task, "seed": seed, "members": members, "metric": metric, "weights":
            [m["weight"] for m in side["members"]], "vote_loss": vote["eval_loss"], "vote_metric": vote[metric],
            "uniform_loss": side["uniform"]["eval_loss"], "uniform_metric": side["uniform"][metric],
            "best_loss": best_loss, "best_metric": best_metric,
            "member_losses": [m["eval_loss"] for m in side["members"]],
            "never_worse": vote["eval_loss"] <= best_loss and (vote[metric] <= best_metric if lower
                                                               else vote[metric] >= best_metric)}


def dp_curve(case: Case) -> list[tuple[int, float]]:
    """The plain loop at ``peers x batch``, evaluated every 25 steps on the whole test set,
    until the target or ``steps``."""
    import torch

    from ttpeer.daemon._home import shared_data_dir
    from ttpeer.train import LossCurve, load_task

    with tempfile.TemporaryDirectory() as tmp:
        task = load_task(case.task, Path(tmp), shared_data=shared_data_dir())
    torch.manual_seed(case.seed)
    run = LossCurve(task, case.peers * case.batch, lr=case.lr, weight_decay=WEIGHT_DECAY, seed=case.seed,
                    eval_samples=task.n_test)
    while run.step < case.steps:
        run.advance(25)
        if run.evaluate() <= case.target:
            break
    return run.points


def run_case(case: Case) -> dict[str, Any]:
    """One case, in this process: its curve and steps to the target."""
    import torch
    import trio

    from ttpeer._advise import steps_to

    torch.set_num_threads(1)
    began = time.perf_counter()
    if case.variant is None:
        curve = dp_curve(case)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            curve = trio.run(run_job, Path(tmp), case)
    return {"task": case.task, "batch": case.batch, "peers": case.peers, "seed": case.seed,
            "variant": case.variant.name if case.variant else "dp", "bits": case.bits,
            "default": bool(case.variant and case.variant.default and case.bits == DEFAULT_BITS),
            "inner_steps": case.variant.h if case.variant else 1,
            "sync": case.variant.sync if case.variant else None,
            "outer": list(case.variant.settings(case.peers, 0.0)) if case.variant else None,  # agree: its ceiling
            "steps": steps_to(curve, case.target), "target": case.target, "curve": curve,
            "seconds": round(time.perf_counter() - began, 1)}


def cases(args: argparse.Namespace) -> list[Case]:
    """Every run the arguments ask for: per task, peer count and seed, the DP bound and
    each variant."""
    out = []
    for task in args.task:
        for peers in args.peers:
            for seed in args.seeds:
                base = Case(task, args.batch, peers, seed, None, args.inner_lr, args.bits, args.steps, args.target)
                out.append(base)
                out += [replace(base, variant=v) for v in args.variants]
    return out


def summary(rows: list[dict[str, Any]]) -> str:
    """Per task, peer count and variant: steps per peer to the target (mean and spread over
    the seeds), against the DP bound and rounds that wait measured beside it."""
    lines = ["| task | batch | peers | variant | outer (lr, momentum) | steps per peer, by seed | mean | / DP bound | "
             "/ wait |", "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["batch"], r["peers"], r["variant"]), []).append(r)

    def mean(key: tuple) -> float | None:
        got = [r["steps"] for r in groups.get(key, [])]
        return statistics.fmean(got) if got and all(s is not None for s in got) else None

    for (task, batch, peers, variant), rs in groups.items():
        seeds = ", ".join(_f(r["steps"]) for r in sorted(rs, key=lambda r: r["seed"]))
        m = mean((task, batch, peers, variant))
        dp, wait = mean((task, batch, peers, "dp")), mean((task, batch, peers, "wait"))
        outer = "" if rs[0]["outer"] is None else "{:g}, {:g}".format(*rs[0]["outer"])
        lines.append(f"| {task} | {batch} | {peers} | {variant}{' (default)' if rs[0]['default'] else ''} | {outer} | "
                     f"{seeds} | {_f(m)} | {_x(m, dp) if variant != 'dp' else ''} | "
                     f"{_x(m, wait) if variant not in ('dp', 'wait') else ''} |")
    return "\n".join(lines)


def with_bounds(rows: list[dict[str, Any]]) -> None:
    """Give every row ``dp_steps``: the DP bound's steps for its task, batch, peers and seed."""
    dp = {(r["task"], r["batch"], r["peers"], r["seed"]): r["steps"] for r in rows if r["variant"] == "dp"}
    for r in rows:
        r["dp_steps"] = dp.get((r["task"], r["batch"], r["peers"], r["seed"]))


def _f(v: float | None) -> str:
    return "not reached" if v is None else f"{v:.0f}"


def _x(a: float | None, b: float | None) -> str:
    return "" if a is None or not b else f"{a / b:.2f}x"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/bench/convergence", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", action="append", default=None,
                    help="a ttpeer task (repeat for several; default mnist1d:samples=60000)")
    ap.add_argument("--batch", type=int, default=4, help="samples per step and peer (default 4)")
    ap.add_argument("--peers", default="2,4", help="peer counts M, comma-separated (default 2,4)")
    ap.add_argument("--seeds", default="0,1,2", help="job seeds (initial weights and data order), default 0,1,2")
    ap.add_argument("--target", type=float, default=None, help="the eval loss to reach (fused runs)")
    ap.add_argument("--ensemble", type=int, default=0, metavar="MEMBERS",
                    help="instead: ensemble jobs of MEMBERS members (units of --inner-steps, --steps per member), "
                         "the vote against its best member on the test set, per task and seed")
    ap.add_argument("--steps", type=int, default=4000, help="most inner steps per peer (default 4000)")
    ap.add_argument("--inner-steps", type=int, default=25, help="inner steps per round (default 25)")
    ap.add_argument("--sync", type=int, default=None,
                    help="overlap: inner steps of round r trained before round r-1's close lands (default: the "
                         "latest the auto cadence allows, inner steps / 1.5)")
    ap.add_argument("--variant", action="append", default=None, metavar="NAME[:key=value,...]",
                    help="a way to run the rounds (repeat for several; default: overlap and wait), e.g. "
                         "overlap:sync=none, wait:mu=0.5,lr=0.7, overlap:h=50")
    ap.add_argument("--inner-lr", type=float, default=2e-3, help="AdamW lr (default 2e-3)")
    ap.add_argument("--bits", type=int, choices=(4, 8), default=DEFAULT_BITS,
                    help=f"bits a delta value is sent in (default {DEFAULT_BITS}, as submit's)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once, one process each (default 2)")
    ap.add_argument("--json", type=Path, default=None, help="also write every run (curve included) here")
    args = ap.parse_args(argv)
    args.task = args.task or ["mnist1d:samples=60000"]
    try:
        args.peers = [int(p) for p in args.peers.split(",")]
        args.seeds = [int(s) for s in args.seeds.split(",")]
        sync = args.sync if args.sync is not None else _lag(args.inner_steps)
        args.variants = [parse_variant(v, args.inner_steps, sync) for v in args.variant or ["overlap", "wait"]]
    except ValueError as exc:
        ap.error(str(exc))
    if min(args.peers) < 1 or args.batch < 1 or args.jobs < 1:
        ap.error("--peers, --batch and --jobs must be >= 1")
    if args.target is None and not args.ensemble:
        ap.error("give --target LOSS (fused runs) or --ensemble MEMBERS")
    return args


def ensembles(args: argparse.Namespace) -> int:
    todo = [(task, args.ensemble, max(1, args.steps // args.inner_steps), args.inner_steps, args.batch, args.inner_lr,
             seed) for task in args.task for seed in args.seeds]
    print(f"{len(todo)} ensemble jobs: {args.ensemble} members x {todo[0][2]} units x {args.inner_steps} steps, "
          f"batch {args.batch}, AdamW lr {args.inner_lr:g} (the members' variants around it)", flush=True)
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(ensemble_row, *zip(*todo, strict=True)))
    print("\n| task | seed | members' test loss | weights | vote, every member once: loss / metric | selected vote: "
          "loss / metric | best member: loss / metric | never worse |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['seed']} | {', '.join(f'{x:.4f}' for x in r['member_losses'])} | {r['weights']} | "
              f"{r['uniform_loss']:.4f} / {r['uniform_metric']:.4f} | {r['vote_loss']:.4f} / {r['vote_metric']:.4f} | "
              f"{r['best_loss']:.4f} / {r['best_metric']:.4f} | {'yes' if r['never_worse'] else 'NO'} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": {"argv": sys.argv[1:]}, "ensembles": rows}, indent=1) + "\n")
    return 0 if all(r["never_worse"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ensemble:
        return ensembles(args)
    todo = cases(args)
    began = time.perf_counter()
    print(f"{len(todo)} runs ({args.jobs} at once): tasks {', '.join(args.task)}, batch {args.batch}, peers "
          f"{args.peers}, seeds {args.seeds}, target eval loss {args.target:g}, AdamW lr {args.inner_lr:g}, "
          f"{args.bits}-bit deltas", flush=True)
    rows = []
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        for row in pool.map(run_case, todo):
            rows.append(row)
            print(f"  {row['task']} M={row['peers']} seed {row['seed']} {row['variant']}: "
                  f"{_f(row['steps'])} steps ({row['seconds']:.0f} s)", flush=True)
    print(f"\n{summary(rows)}\n\n{time.perf_counter() - began:.0f} s", flush=True)
    with_bounds(rows)
    if args.json is not None:
        meta = {"argv": sys.argv[1:] if argv is None else argv, "variants": [asdict(v) for v in args.variants],
                "bits": args.bits, "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
