"""The speedup benchmark behind ``scripts/bench/speedup``.

How much faster 2, 4 and 8 ttpeer peers reach an eval loss than one peer, in the network
lab of ``scripts/bench/wan`` (``ttpeer_harness/netlab.py``: each peer's access link
``--rate`` each way with ``--delay`` added to each direction, peers behind NAT that talk
only through the relay), side by side in one run. One task and batch for every row: the
ttpeer task ``--task`` at batch ``--batch`` per peer, AdamW lr 2e-3 weight decay 0.01,
gradients clipped to 1.0 (``bench/wan_worker.py``'s settings, ttpeer's fused jobs').

Rows, one after the other in one lab:

- ``DP bound`` (no network, no lab): plain training at batch B, 2B, 4B and 8B side by side
  (``bench.scaling.train``), each until the target: steps at B / steps at kB is all that
  perfect synchronous data parallelism on k peers can buy (each step costing the same),
  so k peers' time to the target is at least one peer's times steps at kB / steps at B.
  ``--bound 2=0.52,4=0.29`` gives these ratios instead of measuring them.
- ``1 peer``: the plain single loop (``wan_worker.py single``, no network) with the
  same task, batch, optimizer and ``--slowdown``, stopped at the target. It is the
  reference for every ratio: the DP bound is measured against the same loop, and it is
  what a user gets without ttpeer (no sync, no outer step, its evaluations off its
  clock). ``--rows ...,ttpeer-1`` adds one ttpeer peer alone (a pool of one, the same job
  as the others) to show what ttpeer itself costs a single peer.
- ``2 peers``, ``4 peers``, ``8 peers``: a pool of that many ttpeer peers (fresh homes, own
  hosts, one relay), one fused job with one shard per peer, what ``ttpeer submit`` runs
  (overlap, the pool's outer step, slices from 3 peers) with ``--inner-steps auto``
  (``h_min``/``h_max``: the pool sizes each round so the sync hides behind compute), a
  budget of ``--margin`` (2) x the DP bound's steps per peer (so the job passes the target
  and runs on: the utilization is over the whole job).
- ``4 peers, fixed H``: the 4-peer pool again, ``--fixed-h`` inner steps every round
  (default: the median round size the auto row picked), same budget.
- ``4 peers, all deltas``: the 4-peer pool again, every peer downloading every delta
  (``submit --no-slices``) instead of submit's reduced slices, same budget.

Compute is emulated in every row, so 8 peers fit on 2 cores and a step costs what a GPU's
does: ``--step-ms T`` (the default, 100) makes every step last T ms, sleeping the rest (a
real GPU step of a model people fine-tune takes 0.1-1 s; the daemons' own CPU then costs a
step nothing); ``--slowdown S`` instead makes it last (1 + S) x its real time (what earlier
runs used: every millisecond the daemons take from the shared cores is then paid 1 + S
times). The sleep counts as compute; the table says which emulation ran. Measured per row: wall time until the
eval loss first reaches ``--target`` (single loop: from its start, evaluations off the
clock; ttpeer: from the job's submission, its start-up and each round's evaluation on the
clock), that time / one peer's, / the DP bound's, utilization (ttpeer: each peer's
seconds in inner steps / seconds from the submission to its done, mean over peers),
bytes sent per peer (``tx_bytes`` of ``eth0`` in each peer's namespace), rounds and their
sizes, seconds per step. Prints a markdown table and the targets, writes a PNG.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import signal
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.wan import Row, _baseline, plot, start_peers, ttpeer_row
from ttpeer._parser import DEFAULT_BITS

PEER_COUNTS = (2, 4, 8)
FIRST = 25  # the first rounds' size of an auto job, and the unit of its budget (as `ttpeer submit`)
HOSTS = {"ttpeer-1": ["solo"], "ttpeer-2": ["duo1", "duo2"], "ttpeer-4": ["quad1", "quad2", "quad3", "quad4"],
         "ttpeer-8": [f"oct{i}" for i in range(1, 9)]}
ROWS = ("single", "ttpeer-1", "ttpeer-2", "ttpeer-4", "ttpeer-8", "ttpeer-4-fixed", "ttpeer-4-all")
AGAIN = ("ttpeer-4-fixed", "ttpeer-4-all")  # rows that run the 4-peer pool again, another way
DEFAULT_ROWS = "single,ttpeer-2,ttpeer-4,ttpeer-8"
GOALS = {2: 0.58, 4: 0.33, 8: 0.22}  # N peers' time to the target / one peer's
BOUND_GOAL = 1.15  # fused time / the perfect-data-parallel bound's
UTIL_GOAL, UTIL_ROUNDS = 0.95, 20
TASK_GOALS = {2: 0.51, 4: 0.29, 8: 0.19}  # a task fit for the targets: DP bound at most this
STEP_MS = 100.0  # the default emulated step


@dataclass
class Result:
    peers: int
    row: Row
    auto: bool = False  # ttpeer with --inner-steps auto


def parse_bound(text: str) -> dict[int, float]:
    """``2=0.52,4=0.29`` -> {2: 0.52, 4: 0.29}: N peers' steps to the target / one peer's."""
    out: dict[int, float] = {}
    for part in filter(None, text.split(",")):
        k, sep, v = part.partition("=")
        try:
            peers, ratio = int(k), float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected N=RATIO,... like 2=0.52,4=0.29, not {text!r}") from None
        if not sep or peers < 2 or not 0 < ratio <= 1:
            raise argparse.ArgumentTypeError(f"each N >= 2 and 0 < RATIO <= 1, not {part!r}")
        out[peers] = ratio
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/bench/speedup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a short run: target 1.2, budget margin 1.6, no fixed-H row (about 6 minutes)")
    ap.add_argument("--rate", default="20mbit")
    ap.add_argument("--delay", type=float, default=0.05, help="seconds added to each direction")
    ap.add_argument("--task", default="mnist1d:samples=60000", help="the ttpeer task every row trains")
    ap.add_argument("--batch", type=int, default=4, help="samples per step and peer (default 4)")
    ap.add_argument("--target", type=float, default=None, help="target eval loss (default 1.0; --quick 1.2)")
    ap.add_argument("--step-ms", type=float, default=None,
                    help=f"emulated compute: every step lasts this many ms, sleeping the rest (default {STEP_MS:g})")
    ap.add_argument("--slowdown", type=float, default=None,
                    help="emulated compute instead: each step lasts (1 + S) x its real time (sleeping)")
    ap.add_argument("--h-min", type=int, default=10, help="auto rows: the smallest round (inner steps)")
    ap.add_argument("--h-max", type=int, default=200, help="auto rows: the largest round (inner steps)")
    ap.add_argument("--fixed-h", type=int, default=0,
                    help="the fixed-H row's inner steps per round (default: the 4-peer auto row's median size)")
    ap.add_argument("--margin", type=float, default=None,
                    help="a ttpeer row's budget per peer: this x the DP bound's steps (default 2; --quick 1.6)")
    ap.add_argument("--bound", type=parse_bound, default=None, metavar="N=RATIO,...",
                    help="DP bound ratios (steps at N*B / steps at B) instead of measuring them")
    ap.add_argument("--bound-steps", type=int, default=8000, help="DP bound: most steps at batch B (default 8000)")
    ap.add_argument("--bits", type=int, choices=(4, 8), default=DEFAULT_BITS,
                    help=f"ttpeer: bits per delta value (default {DEFAULT_BITS}, as submit's)")
    ap.add_argument("--outer-lr", type=float, default=None,
                    help="a fixed outer lr (default: each close picks its outer step, as submit's jobs do)")
    ap.add_argument("--outer-momentum", type=float, default=None, help="a fixed outer momentum (as --outer-lr)")
    ap.add_argument("--no-overlap", action="store_true", help="ttpeer rows: rounds that wait (submit --no-overlap)")
    ap.add_argument("--rows", default=DEFAULT_ROWS, help=f"which rows to run, of {','.join(ROWS)}")
    ap.add_argument("--png", type=Path, default=Path("docs/bench-speedup.png"))
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    ap.add_argument("--json", type=Path, default=None, help="also write every row's curve and counts here")
    ap.add_argument("--keep", action="store_true", help="keep the lab's directory (logs)")
    args = ap.parse_args(argv)
    rows = args.rows.split(",")
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        ap.error(f"unknown rows {','.join(unknown)}: use {','.join(ROWS)}")
    if "single" not in rows:
        ap.error("every ratio is to the single loop's time: --rows needs single")
    args.rows = [r for r in ROWS if r in rows]
    if args.quick and "--rows" not in " ".join(argv or sys.argv[1:]):
        args.rows = [r for r in args.rows if r != "ttpeer-4-fixed"]
    args.target = args.target if args.target is not None else (1.2 if args.quick else 1.0)
    args.margin = args.margin if args.margin is not None else (1.6 if args.quick else 2.0)
    if not 1 <= args.h_min <= args.h_max or args.batch < 1 or args.fixed_h < 0 or args.margin <= 0:
        ap.error("need 1 <= --h-min <= --h-max, --batch >= 1, --fixed-h >= 0, --margin > 0")
    if args.step_ms is not None and args.slowdown is not None:
        ap.error("emulate compute one way: --step-ms or --slowdown")
    if args.slowdown is None and args.step_ms is None:
        args.step_ms = STEP_MS
    return args


def emulation(args: argparse.Namespace) -> tuple[str, ...]:
    """The flags that emulate compute, for the loop and every daemon alike."""
    if args.step_ms is not None:
        return ("--step-s", f"{args.step_ms / 1000:g}")
    return ("--slowdown", f"{args.slowdown:g}")


def emulation_words(args: argparse.Namespace) -> str:
    return (f"every step lasts {args.step_ms:g} ms (sleeping what the CPU leaves)" if args.step_ms is not None
            else f"steps slowed {1 + args.slowdown:g}x (each sleeps {args.slowdown:g}x its real time)")


def step_guess(args: argparse.Namespace) -> float:
    """Seconds a step takes, to size time limits (a real mnist1d step at batch 4: about 5 ms)."""
    return max(args.step_ms / 1000, 0.005) if args.step_ms is not None else 0.005 * (1 + args.slowdown)


# -- the pure parts: budgets, ratios, the table --------------------------------------------


def budget_rounds(bound_steps: float, margin: float) -> int:
    """A job's ``rounds`` (its budget in units of ``FIRST`` inner steps per shard) for
    ``margin`` x ``bound_steps``, the DP bound's steps per peer to the target."""
    return max(1, math.ceil(margin * bound_steps / FIRST))


def bound_ratios(steps: dict[int, float | None]) -> dict[int, float]:
    """{k: steps at k*B / steps at B} from steps to the target by peer count (1 included)."""
    one = steps.get(1)
    return {k: s / one for k, s in steps.items() if k != 1 and s and one}


def vs(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(single: Row, results: list[Result], bounds: dict[int, float], target: float) -> str:
    """The rows side by side, then the targets, each as measured."""
    t1 = single.time_to(target)
    lines = [f"| row | peers | time to eval loss {target:g} | vs one peer | DP bound (vs one peer) | "
             "vs DP bound | rounds (inner steps each) | utilization | bytes sent / peer | bytes / sample | "
             "s / step | final eval loss |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for peers, row in [(1, single), *((r.peers, r.row) for r in results)]:
        if not row.curve:
            lines.append(f"| {row.name} | {peers} | {row.note} | | | | | | | | | |")
            continue
        t = row.time_to(target)
        bound = bounds.get(peers) if peers > 1 else None
        ratio = vs(t, t1)
        lines.append(" | ".join([
            f"| {row.name}", str(peers),
            f"{t:.1f} s" if t is not None else f"not reached in {row.wall:.0f} s (at {row.curve[-1][2]:.3f})",
            _x(ratio) if peers > 1 else "1", _x(bound), _x(vs(ratio, bound)), _rounds(row.rounds),
            f"{row.utilization:.1%}" if row.utilization is not None else "n/a",
            f"{sum(row.sent) / len(row.sent) / 1e6:.2f} MB" if row.sent else "0",
            f"{sum(row.sent) / row.samples:,.1f}" if row.samples else "n/a",
            f"{row.step_s * 1000:.1f} ms" if row.step_s else "n/a", f"{row.curve[-1][2]:.4f} |"]))
    return "\n".join([*lines, "", "Targets:", "", targets(single, results, bounds, target)])


def targets(single: Row, results: list[Result], bounds: dict[int, float], target: float) -> str:
    t1 = single.time_to(target)
    out = ["| target | measured | met |", "|---|---|---|"]

    def line(what: str, value: float | None, ok: bool, fmt: str = "{:.2f}x") -> None:
        out.append(f"| {what} | {fmt.format(value) if value is not None else 'n/a'} | "
                   f"{'yes' if value is not None and ok else 'no'} |")

    for k, goal in TASK_GOALS.items():
        b = bounds.get(k)
        line(f"(the task) DP bound, {k} peers (<= {goal:.2f}x)", b, b is not None and b <= goal)
    for res in results:
        if not res.auto:
            continue
        r, k = res.row, res.peers
        ratio = vs(r.time_to(target), t1)
        if k in GOALS:
            line(f"{r.name}: time to target / one peer's (<= {GOALS[k]:.2f}x)", ratio,
                 ratio is not None and ratio <= GOALS[k])
        over = vs(ratio, bounds.get(k))
        if k > 1:
            line(f"{r.name}: time to target / the DP bound's (<= {BOUND_GOAL:.2f}x)", over,
                 over is not None and over <= BOUND_GOAL)
        u = r.utilization
        line(f"{r.name}: utilization over {len(r.rounds)} rounds (>= {UTIL_GOAL:.0%} over >= {UTIL_ROUNDS})", u,
             u is not None and u >= UTIL_GOAL and len(r.rounds) >= UTIL_ROUNDS, "{:.1%}")
    return "\n".join(out)


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "n/a"


def _rounds(sizes: list[int]) -> str:
    """``24 (25, 25, 40 ... 31)``: the count, then the sizes (the middle elided past 8)."""
    if not sizes:
        return "-"
    shown = sizes if len(sizes) <= 8 else [*sizes[:4], "...", *sizes[-3:]]
    return f"{len(sizes)} ({', '.join(map(str, shown))})"


# -- the runs --------------------------------------------------------------------------------


def measure_bound(args: argparse.Namespace, data: Path) -> tuple[dict[int, float | None], float]:
    """Steps to the target at B, 2B, 4B and 8B (plain training, side by side); and the seconds."""
    import time

    from bench.scaling import steps_to, train

    began = time.perf_counter()
    ks = (1, *PEER_COUNTS)
    every = max(5, min(25, args.bound_steps // 200))
    with concurrent.futures.ProcessPoolExecutor(len(ks)) as pool:
        runs = {k: pool.submit(train, args.task, data, k * args.batch, args.bound_steps, every, 1 << 30, 0,
                               args.target) for k in ks}
        curves = {k: r.result() for k, r in runs.items()}
    return {k: steps_to(c, args.target) for k, c in curves.items()}, time.perf_counter() - began


def run(args: argparse.Namespace) -> tuple[Row, list[Result], dict[int, float], dict[int, float | None]]:
    from ttpeer.train import load_task
    from ttpeer_harness import job_spec
    from ttpeer_harness.netlab import Lab, start_relay

    hosts = sorted({h for r in args.rows if r.startswith("ttpeer") for h in _hosts(r)})
    results: list[Result] = []
    with Lab(nat=["single", *hosts], keep=args.keep) as lab:
        for name in ["single", *hosts]:
            lab.shape(name, args.rate, args.delay)
        data = lab.dir / "data"
        data.mkdir()
        load_task(args.task, data)  # generated once: the workers and the peers find the cache
        print(f"lab in {lab.dir}", file=sys.stderr)
        steps: dict[int, float | None] = {}
        if args.bound is None:
            print("DP bound: batch B, 2B, 4B to the target...", file=sys.stderr)
            steps, secs = measure_bound(args, data)
            print(f"  steps to {args.target:g}: {steps} ({secs:.0f} s)", file=sys.stderr)
            bounds = bound_ratios(steps)
        else:
            bounds = args.bound
        if not all(k in bounds for k in PEER_COUNTS):
            raise RuntimeError(f"the DP bound needs a ratio for {PEER_COUNTS} peers; measured {steps}: raise "
                               "--bound-steps or the target")
        one = steps.get(1) or args.bound_steps / 2  # sizes the budgets; --bound: an upper guess
        common = ["--data", str(data), "--task", args.task, "--batch", str(args.batch), "--target",
                  str(args.target), *emulation(args)]
        print("1 peer, the plain loop...", file=sys.stderr)
        cap = 2 * int(one)  # steps: the loop stops at the target, or here if it never gets there
        single = _baseline(lab, "1 peer (plain loop)", "single", [lab.hosts["single"]],
                           [*common, "--steps", str(cap), "--stop-at-target", "--eval-every", str(FIRST)],
                           cap * step_guess(args), [[]])
        if single.samples and single.utilization is not None:  # its busy seconds per step
            single.step_s = single.utilization * single.wall / (single.samples / args.batch)
        relay = start_relay(lab)
        base = {**job_spec(1), "task": args.task, "bits": args.bits, "batch_size": args.batch, "batches": FIRST,
                "lease": 60.0, **outer_fields(args), "overlap": 0 if args.no_overlap else 1, **slice_fields()}
        auto = {"h_min": args.h_min, "h_max": args.h_max}
        homes4: dict[str, Path] = {}
        for row in args.rows:
            if row == "single":
                continue
            peers = int(row.split("-")[1])
            rounds = budget_rounds(one * bounds.get(peers, 1.0), args.margin)
            spec = {**base, "shards": peers, "rounds": rounds}
            if row == "ttpeer-4-fixed":
                h = args.fixed_h or _median_size(results, 4) or FIRST
                spec = {**spec, "batches": h, "rounds": max(1, round(rounds * FIRST / h))}
                name = f"{peers} peers, fixed H={h}"
            elif row == "ttpeer-4-all":
                spec = {**{k: v for k, v in spec.items() if k not in slice_fields()}, **auto}
                name = f"{peers} peers, auto H {args.h_min}-{args.h_max}, all deltas"
            else:
                spec = {**spec, **auto}
                name = f"{peers} peer{'s' * (peers > 1)}, auto H {args.h_min}-{args.h_max}"
            print(f"{name}...", file=sys.stderr)
            homes = homes4 if row in AGAIN and homes4 else start_peers(lab, relay, _hosts(row), emulation(args))
            timeout = 600 + 3 * _budget_steps(spec) * step_guess(args)  # generous: a failure, not a figure
            results.append(Result(peers, ttpeer_row(lab, homes, spec, name, timeout), auto=row != "ttpeer-4-fixed"))
            later = args.rows[args.rows.index(row) + 1:]
            if row in ("ttpeer-4", *AGAIN) and any(again in later for again in AGAIN):
                homes4 = homes  # a later row runs this pool again
            else:
                for host in _hosts(row):
                    lab.stop(host)  # an idle pool still heartbeats: off the next rows' cores
    return single, results, bounds, steps


def _hosts(row: str) -> list[str]:
    """The lab's hosts of a ttpeer row (a row that runs the 4-peer pool again: its hosts)."""
    return HOSTS[row if row in HOSTS else "ttpeer-4"]


def slice_fields() -> dict[str, int]:
    """Submit's defaults for a fused job's slices (``chunk``, ``slice_bits``, ``slice_min``:
    submit's own function), so every row but ``all deltas`` runs what ``ttpeer submit`` runs."""
    from ttpeer._submit_cmd import slices_fields

    return slices_fields(argparse.Namespace(mode="fused", slices=None, no_slices=False, slice_bits=None))


def outer_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The job's outer step: the pool's (as ``ttpeer submit`` gives), unless fixed by a flag."""
    from ttpeer.proto import outer_settings

    if args.outer_lr is None and args.outer_momentum is None:
        first = outer_settings(2, FIRST, agree=True)
        return {"outer_lr": first.lr, "outer_momentum": first.momentum, "outer_auto": 2}
    return {"outer_lr": 0.7 if args.outer_lr is None else args.outer_lr,
            "outer_momentum": 0.7 if args.outer_momentum is None else args.outer_momentum}


def _outer_words(args: argparse.Namespace) -> str:
    if args.outer_lr is None and args.outer_momentum is None:
        return "the pool's outer step (each close's)"
    fixed = outer_fields(args)
    return f"outer lr {fixed['outer_lr']:g} momentum {fixed['outer_momentum']:g}"


def _budget_steps(spec: dict[str, Any]) -> int:
    return int(spec["rounds"]) * int(spec["batches"])


def _median_size(results: list[Result], peers: int) -> int | None:
    sizes = next((r.row.rounds for r in results if r.peers == peers and r.auto), None)
    return round(statistics.median(sizes)) if sizes else None


def main(argv: list[str] | None = None) -> int:
    from ttpeer_harness.netlab import unavailable

    args = parse_args(argv)
    # A TERM (a timeout, a background run stopped) unwinds through ``with Lab``: it cleans up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = unavailable()
    if why:
        print(f"scripts/bench/speedup needs the network lab: {why}", file=sys.stderr)
        return 2
    load = os.getloadavg()
    single, results, bounds, steps = run(args)
    text = table(single, results, bounds, args.target)
    measured = ", ".join(f"{s:.0f}" if s else "-" for s in steps.values())
    head = (f"1, 2, 4 and 8 peers, each link {args.rate} each way + {args.delay * 1000:.0f} ms each direction, NAT, "
            f"the relay; task {args.task}, batch {args.batch} per peer, target eval loss {args.target:g}; ttpeer: "
            f"{'no overlap' if args.no_overlap else 'overlap'}, {args.bits}-bit deltas, {_outer_words(args)}; "
            f"emulated compute: {emulation_words(args)}; DP bound "
            + (f"measured (steps to the target at B, 2B, 4B, 8B: {measured})" if steps else "given") +
            f"; load average at start {load[0]:.2f}, at end {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    notes = "\n".join(f"- {r.name}: {r.note}" for r in [single, *(x.row for x in results)] if r.curve and r.note)
    text = f"{text}\n\n{notes}" if notes else text
    print(f"\n{head}\n\n{text}\n")
    args.png.parent.mkdir(parents=True, exist_ok=True)
    plot([single, *(r.row for r in results)], args.target, args.png, head)
    print(f"plot: {args.png}")
    if args.json:
        args.json.write_text(json.dumps({"head": head, "bounds": bounds, "steps": steps,
                                         "rows": [single.__dict__, *(r.row.__dict__ for r in results)]}, indent=1))
    if args.markdown:
        args.markdown.write_text(f"{head}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
