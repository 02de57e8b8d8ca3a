"""The batch-scaling benchmark behind ``scripts/bench/scaling``: how much a second peer
can help a task at all, before any network.

Two peers training one model see twice the samples per step. The most that can buy
is what perfect data parallelism buys: synchronous training at twice the batch. So this
trains the task's model at batch B (one peer) and at 2B (two peers, perfectly
synchronised), side by side in two processes, with the settings of every row of
``scripts/bench/wan`` (AdamW lr 2e-3, weight decay 0.01, gradients clipped to 1.0, the
same seed), and prints, for eval losses both runs reach, the steps each needed and
their ratio. One peer's time over two peers' is at most that ratio (each step costs
the same), so the WAN benchmark's target (2 peers in <= 0.6x one peer's time) needs a
ratio of at least 1.67 at the target loss; DiLoCo, which averages every H steps, gets
less than the ratio, never more. A ratio near 2 means the task is in the regime where
more peers help nearly linearly; near 1, a second peer adds little however fast the
network is. ``--multiples 2,4`` also trains at 4B (four peers), for the bound of
``scripts/bench/speedup``: steps at B / steps at kB for each k, one process per batch.

The learning rate is not scaled with the batch: every row of the WAN benchmark uses
the same one, so this measures what those rows can get.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time
from pathlib import Path

from ttpeer._advise import steps_to
from ttpeer.config import _default_home

DEFAULT_TASK = "mnist1d:samples=60000"


def train(task_name: str, data: Path, batch: int, steps: int, every: int, eval_samples: int,
          seed: int, until: float | None = None) -> list[tuple[int, float]]:
    """(step, eval loss) every ``every`` steps of plain AdamW training at ``batch``; stops
    early at the first evaluation at or below ``until``, if given."""
    import torch

    from bench.wan_worker import LR, WEIGHT_DECAY
    from ttpeer.train import LossCurve, load_task

    torch.set_num_threads(1)  # the two runs share the machine evenly
    run = LossCurve(load_task(task_name, data), batch, lr=LR, weight_decay=WEIGHT_DECAY, seed=seed,
                    eval_samples=eval_samples)
    for _ in range(steps // every):
        run.advance(every)
        run.evaluate()
        if until is not None and run.points[-1][1] <= until:
            break
    return run.points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench/scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default=DEFAULT_TASK, help=f"a ttpeer task (default {DEFAULT_TASK})")
    ap.add_argument("--batch", type=int, default=64, help="one peer's batch B (default 64, as in the WAN bench)")
    ap.add_argument("--steps", type=int, default=2000, help="steps at batch B (default 2000); kB runs as many")
    ap.add_argument("--multiples", type=_multiples, default=(2,), metavar="K[,K...]",
                    help="the peer counts k to train batch kB for (default 2; e.g. 2,4)")
    ap.add_argument("--every", type=int, default=50, help="evaluate every this many steps (default 50)")
    ap.add_argument("--eval-samples", type=int, default=4000, help="test samples evaluated (default 4000)")
    ap.add_argument("--losses", default="", help="comma-separated eval losses to report (default: 8 "
                    "evenly spaced, down to the last loss both runs reached)")
    ap.add_argument("--data", type=Path, default=_default_home() / "data",
                    help="where built-in tasks keep their data (default: the daemon's, HOME/data)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.batch < 1 or args.steps < args.every or args.every < 1:
        ap.error("--batch and --every must be >= 1 and --steps >= --every")
    began = time.perf_counter()
    ks = args.multiples
    batches = [args.batch, *(k * args.batch for k in ks)]
    with concurrent.futures.ProcessPoolExecutor(len(batches)) as pool:
        runs = [pool.submit(train, args.task, args.data, b, args.steps, args.every, args.eval_samples,
                            args.seed) for b in batches]
        curves = [r.result() for r in runs]
    if args.losses:
        losses = [float(x) for x in args.losses.split(",")]
    else:  # below every first evaluation, down to the last loss every run reached
        top, bottom = min(c[0][1] for c in curves), max(c[-1][1] for c in curves)
        losses = [round(top - (top - bottom) * i / 8, 3) for i in range(1, 9)]
    b = args.batch
    peers = " and ".join(f"{k * b} ({_PEERS.get(k, f'{k} peers')}, perfectly synchronised)" for k in ks)
    print(f"\nbatch scaling of {args.task}: batch {b} (one peer) against {peers}; {args.steps} steps each, "
          f"eval every {args.every} on {args.eval_samples} test samples; {time.perf_counter() - began:.0f} s\n")
    print(f"| eval loss | steps at batch {b} | " + " | ".join(
        f"steps at batch {k * b} | ratio | best {k}-peer time / one peer's" for k in ks) + " |")
    print("|---|---|" + "---|---|---|" * len(ks))
    for loss in losses:
        s1 = steps_to(curves[0], loss)
        cells = [str(loss), _fmt(s1)]
        for curve in curves[1:]:
            sk = steps_to(curve, loss)
            cells += [_fmt(sk), "-", "-"] if s1 is None or sk is None else [
                f"{sk:.0f}", f"{s1 / sk:.2f}", f"{sk / s1:.2f}x"]
        print("| " + " | ".join(cells) + " |")
    print("\nlast eval loss: " + ", ".join(f"{c[-1][1]:.4f} at batch {bk}" for c, bk in zip(curves, batches,
                                                                                         strict=True)))
    return 0


_PEERS = {2: "two peers", 4: "four peers"}


def _multiples(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(k) for k in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected peer counts like 2,4, not {text!r}") from None
    if not ks or any(k < 2 for k in ks) or len(set(ks)) != len(ks):
        raise argparse.ArgumentTypeError(f"peer counts must be distinct and >= 2, not {text!r}")
    return ks


def _fmt(steps: float | None) -> str:
    return "not reached" if steps is None else f"{steps:.0f}"


if __name__ == "__main__":
    raise SystemExit(main())
