"""Fits the steps model of ``ttpeer advise`` (``ttpeer/_advise.py``: ``H_HALF``,
``NOISE_EXPONENT``, ``OVERLAP_COST``) on the convergence lab's runs, and prints the model
against every cell it was fitted on.

A cell is one task, batch, peer count, variant and delta bits of ``scripts/bench/convergence``, run
with the pool's outer rule (variants with ``mu=``, ``lr=``, ``agree=0`` or ``sync=none``
are left out: ``submit`` never runs them); its steps per peer and its DP bound are means
over the seeds. The data-parallel gain is g(n) = S1 / DP(n), S1 being the DP bound of one
peer at the same batch (rows of 1 peer: the outer rule plays no part in them). The model
predicts steps / DP = g / g_eff (``_advise.predict``'s arithmetic, the lag being the
cell's ``sync``); the fit is least squares in its log, over a grid.

    scripts/bench/advise-fit [--lab docs/lab-agreement.json] [--runs KEY,...] [--ones FILE,...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ttpeer import _advise

DOCS = Path(__file__).parents[1] / "docs"
# The lab's runs of the pool's current outer rule (the momentum by agreement), both tasks.
RUNS = ("c32-agree-2-4", "c32-agree-8", "c32-agree-4-short-overlap", "c32-margin-agree", "m16-agree-2", "m16-agree-4-8",
        "m16-margin-agree", "m4-agree")
# Where the one-peer DP bounds are (mnist1d at batch 4 and 16, charlm at 32).
ONES = ("lab-mnist1d-b4.json", "lab-mnist1d-b16.json", "lab-charlm-b32.json")
OFF_RULE = ("mu=", "lr=", "agree=0", "sync=none")
GRID = {"h_half": [float(h) for h in range(100, 1501, 25)],
        "noise": [k / 20 for k in range(0, 41)],
        "overlap": [c / 20 for c in range(0, 41)]}


@dataclass(frozen=True)
class Cell:
    task: str
    batch: int
    peers: int
    variant: str
    h: int
    lag: float  # steps of the round trained before the close of the one before lands
    measured: float  # steps per peer / the DP bound, means over the seeds
    gain: float  # g(n) = S1 / DP(n)

    @property
    def overlap(self) -> bool:
        return self.variant.startswith("overlap")


def _task(name: str) -> str:
    return name.partition(":")[0]


def one_peer_bounds(paths: Sequence[Path]) -> dict[tuple[str, int], float]:
    """(task, batch) -> the mean DP bound of one peer over the seeds in ``paths``."""
    got: dict[tuple[str, int], list[float]] = {}
    for path in paths:
        for r in json.loads(path.read_text())["rows"]:
            if r["peers"] == 1 and r["variant"] == "dp" and r["steps"] is not None:
                got.setdefault((_task(r["task"]), r["batch"]), []).append(r["steps"])
    return {k: statistics.fmean(v) for k, v in got.items()}


def cells(lab: Path, runs: Sequence[str], ones: dict[tuple[str, int], float]) -> list[Cell]:
    """The fitted cells of ``runs`` (keys of ``lab``, each a ``--json`` output). Raises
    KeyError for a run ``lab`` lacks; a cell with a seed that missed the target, or with
    no one-peer bound for its task and batch, is left out."""
    data = json.loads(lab.read_text())
    groups: dict[tuple, list[tuple[float | None, float | None]]] = {}
    for key in runs:
        for r in data[key]["rows"]:
            if r["variant"] == "dp" or r["peers"] < 2 or any(o in r["variant"] for o in OFF_RULE):
                continue
            bits = r.get("bits", 8)  # the lab's rows name their bits since it sent 4 by default
            at = (_task(r["task"]), r["batch"], r["peers"], r["variant"], r["inner_steps"], r["sync"], bits)
            groups.setdefault(at, []).append((r["steps"], r["dp_steps"]))
    out = []
    for (task, batch, peers, variant, h, lag, _bits), seeds in sorted(groups.items()):
        if (task, batch) not in ones or any(s is None or d is None for s, d in seeds):
            continue
        steps = statistics.fmean(s for s, _d in seeds if s is not None)
        dp = statistics.fmean(d for _s, d in seeds if d is not None)
        out.append(Cell(task, batch, peers, variant, h, lag, steps / dp, ones[(task, batch)] / dp))
    return out


def predicted(cell: Cell, h_half: float, noise: float, overlap: float) -> float:
    """steps / DP by ``ttpeer advise``'s model with these constants (``_advise.kept``,
    ``_advise.lag_cost``): g(n) / g_eff."""
    g = max(1.0, cell.gain)
    cost = _advise.lag_cost(cell.lag, cell.h, cell.peers, overlap) if cell.overlap else 1.0
    return g / ((1.0 + (g - 1.0) * _advise.kept(cell.h, cell.peers, g, h_half=h_half, noise=noise)) / cost)


def error(fitted: Sequence[Cell], h_half: float, noise: float, overlap: float) -> float:
    return sum(math.log(predicted(c, h_half, noise, overlap) / c.measured) ** 2 for c in fitted)


def fit(fitted: Sequence[Cell], grid: dict[str, list[float]] = GRID) -> tuple[float, float, float]:
    """The constants of ``grid`` (``GRID``'s keys) with the least error."""
    points = itertools.product(grid["h_half"], grid["noise"], grid["overlap"])
    return min(points, key=lambda k: error(fitted, *k))


def around(constants: tuple[float, float, float]) -> dict[str, list[float]]:
    """``GRID``'s points next to ``constants`` (and they): a fit on it is a check that they
    are the least error there, in a thirtieth of the whole grid's time."""
    out = {}
    for key, value in zip(("h_half", "noise", "overlap"), constants, strict=True):
        axis = GRID[key]
        i = min(range(len(axis)), key=lambda j: abs(axis[j] - value))
        out[key] = axis[max(0, i - 1):i + 2]
    return out


def report(fitted: Sequence[Cell], constants: tuple[float, float, float]) -> list[str]:
    lines = ["| task | batch | peers | variant | H | lag | g(n) | measured / DP | model / DP | measured / model |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in fitted:
        p = predicted(c, *constants)
        lines.append(f"| {c.task} | {c.batch} | {c.peers} | {c.variant} | {c.h} | {c.lag} | {c.gain:.2f} | "
                     f"{c.measured:.2f}x | {p:.2f}x | {c.measured / p:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench/advise-fit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lab", type=Path, default=DOCS / "lab-agreement.json",
                    help="runs of scripts/bench/convergence --json, one per key (default docs/lab-agreement.json)")
    ap.add_argument("--runs", default=",".join(RUNS), help="the keys to fit on (default: the current rule's runs)")
    ap.add_argument("--ones", default=",".join(str(DOCS / o) for o in ONES),
                    help="lab JSON files with the one-peer DP bounds (rows of --peers 1)")
    args = ap.parse_args(argv)
    try:
        ones = one_peer_bounds([Path(p) for p in args.ones.split(",")])
        fitted = cells(args.lab, args.runs.split(","), ones)
    except (OSError, ValueError, KeyError) as exc:
        ap.error(f"cannot read the lab's runs: {exc}")
    if not fitted:
        ap.error("no cell to fit: no run of the pool's rule with a one-peer bound for its task and batch")
    now = (_advise.H_HALF, _advise.NOISE_EXPONENT, _advise.OVERLAP_COST)
    best = fit(fitted)
    for name, k in (("in ttpeer/_advise.py", now), ("fitted", best)):
        ratios = [c.measured / predicted(c, *k) for c in fitted]
        print(f"{name}: H_HALF {k[0]:g}, NOISE_EXPONENT {k[1]:g}, OVERLAP_COST {k[2]:g}: squared log error "
              f"{error(fitted, *k):.3f}, measured / model {min(ratios):.2f}-{max(ratios):.2f} over {len(fitted)} cells")
    print("\n" + "\n".join(report(fitted, now)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
