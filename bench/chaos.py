"""``scripts/chaos``: a randomized fault campaign on real processes, with checkers.

Each run draws from its seed (``_chaos_plan.draw``) a pool of 3-5 peers, a fused or an
ensemble mnist1d job and 1-3 faults at random times; builds the pool on loopback (two
real relays over TLS, every daemon a ``ttpeer`` process with its worker processes, each
peer reaching the relays only through its own cuttable CONNECT proxy); applies the
faults; waits for the job to end; and judges the run (``_chaos_check``). Run ``i`` of
``--seed S`` has seed ``S + i``, so ``--seed S+i --runs 1`` replays it exactly as drawn.

    scripts/chaos                       # 10 runs from seed 0
    scripts/chaos --runs 100 --seed 1000 --json chaos.json
    scripts/chaos --seed 17 --runs 1 --keep   # replay one run, keep its folder to read
    scripts/chaos --load                # 8 peers, 3 jobs and a dataset on one relay: its footprint

Output: one line per run (seed, pool, faults, outcome, seconds), then a table by fault
kind and a last line ``N runs, M faults, K violations``; the exit status is 1 when K > 0.
Faults that need root (a tmpfs home for the full disk) are skipped without it, and the
summary says so. A run with a violation keeps its folder (every process's log, every
home) and prints where.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from ._chaos_check import check
from ._chaos_plan import KINDS, NEEDS_ROOT, Plan, draw
from ._chaos_proxy import proxies
from ._chaos_run import Result, Runner


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


def one_run(seed: int, root: Path, *, root_user: bool) -> tuple[Result, list[str]]:
    """Draw, run and judge the run of ``seed`` in ``root``; its result and violations."""
    plan = draw(seed, root=root_user)
    with proxies() as gates:
        runner = Runner(plan, root, gates, root_user=root_user)
        try:
            res = runner.run()
            violations = check(res)
        finally:
            runner.pool.close()
    return res, violations


def line(res: Result, violations: list[str]) -> str:
    p: Plan = res.plan
    outcome = "ok" if not violations else f"{len(violations)} VIOLATION{'S' if len(violations) > 1 else ''}"
    skipped = f" (skipped: {'; '.join(res.skipped)})" if res.skipped else ""
    return (f"seed {p.seed:<5} {p.peers} peers {p.mode:<8} faults: {p.describe()}{skipped}  "
            f"-> {outcome}  {res.seconds:.0f} s")


def summary(results: list[tuple[Result, list[str]]]) -> list[str]:
    drawn: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    bad: Counter[str] = Counter()
    for res, violations in results:
        for f in res.plan.faults:
            drawn[f.kind] += 1
            if any(s.startswith(f.describe(res.plan.names)) or s.startswith(f"{f.kind}(") for s in res.skipped):
                skipped[f.kind] += 1
            if violations:
                bad[f.kind] += 1
    rows = ["", f"{'fault':<14} {'drawn':>6} {'injected':>9} {'runs with a violation':>22}  what it does"]
    for kind, what in KINDS.items():
        rows.append(f"{kind:<14} {drawn[kind]:>6} {drawn[kind] - skipped[kind]:>9} {bad[kind]:>22}  {what}")
    return rows


def load(folder: Path | None) -> int:
    from ._chaos_load import load_run

    base = folder or Path(tempfile.mkdtemp(prefix="ttpeer-chaos-load-"))
    base.mkdir(parents=True, exist_ok=True)
    with proxies() as gates:
        report, violations = load_run(base, gates)
    for row in report + [f"    {v}" for v in violations]:
        print(row)
    print(f"load: {len(violations)} violations" + (f" (logs and homes kept in {base})" if violations else ""))
    if not violations and folder is None:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if violations else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/chaos", description=__doc__.split("\n\n")[0].replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]).replace("``", ""))
    parser.add_argument("--runs", type=int, default=10, help="how many runs (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="the first run's seed (default 0)")
    parser.add_argument("--keep", action="store_true", help="keep every run's folder, not only failed ones")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write every run's plan, outcome and journal")
    parser.add_argument("--dir", type=Path, help="where the runs' folders go (default: a new temporary folder)")
    parser.add_argument("--load", action="store_true",
                        help="instead of the campaign: 8 peers, 3 concurrent jobs and a dataset on one relay")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.load:
        return load(args.dir)
    root_user = can_mount()
    if not root_user:
        print(f"not root (or no 'mount'): {', '.join(NEEDS_ROOT)} faults are skipped "
              f"({'; '.join(NEEDS_ROOT.values())})", flush=True)
    base = args.dir or Path(tempfile.mkdtemp(prefix="ttpeer-chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    results: list[tuple[Result, list[str]]] = []
    started = time.monotonic()
    for seed in range(args.seed, args.seed + args.runs):
        folder = base / f"seed{seed}"
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir()
        res, violations = one_run(seed, folder, root_user=root_user)
        results.append((res, violations))
        print(line(res, violations), flush=True)
        for v in violations:
            print(f"    {v}", flush=True)
        if violations:
            print(f"    logs and homes kept in {folder}; replay: scripts/chaos --seed {seed} --runs 1", flush=True)
        elif not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    for row in summary(results):
        print(row)
    faults = sum(len(r.plan.faults) for r, _ in results)
    injected = faults - sum(len(r.skipped) for r, _ in results)
    violations = sum(len(v) for _, v in results)
    if not root_user:
        print(f"skipped without root: {', '.join(NEEDS_ROOT)}")
    print(f"in {time.monotonic() - started:.0f} s, folders under {base}")
    if args.json:
        args.json.write_text(json.dumps([{
            "seed": r.plan.seed, "peers": r.plan.peers, "mode": r.plan.mode, "rounds": r.plan.rounds,
            "faults": r.plan.describe(), "skipped": r.skipped, "violations": v, "seconds": round(r.seconds, 1),
            "journal": r.journal} for r, v in results], indent=1) + "\n")
    print(f"{len(results)} runs, {injected} faults, {violations} violations")
    if not any(v for _, v in results) and not args.keep and args.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
