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
network is.

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
          seed: int) -> list[tuple[int, float]]:
    """(step, eval loss) every ``every`` steps of plain AdamW training at ``batch``."""
    import torch

    from bench.wan_worker import LR, WEIGHT_DECAY
    from ttpeer.train import LossCurve, load_task

    torch.set_num_threads(1)  # the two runs share the machine evenly
    run = LossCurve(load_task(task_name, data), batch, lr=LR, weight_decay=WEIGHT_DECAY, seed=seed,
                    eval_samples=eval_samples)
    for _ in range(steps // every):
        run.advance(every)
        run.evaluate()
    return run.points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench/scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default=DEFAULT_TASK, help=f"a ttpeer task (default {DEFAULT_TASK})")
    ap.add_argument("--batch", type=int, default=64, help="one peer's batch B (default 64, as in the WAN bench)")
    ap.add_argument("--steps", type=int, default=2000, help="steps at batch B (default 2000); 2B runs as many")
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
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        runs = [pool.submit(train, args.task, args.data, b, args.steps, args.every, args.eval_samples,
                            args.seed) for b in (args.batch, 2 * args.batch)]
        one, two = (r.result() for r in runs)
    if args.losses:
        losses = [float(x) for x in args.losses.split(",")]
    else:  # below both first evaluations, down to the last loss both runs reached
        top, bottom = min(one[0][1], two[0][1]), max(one[-1][1], two[-1][1])
        losses = [round(top - (top - bottom) * i / 8, 3) for i in range(1, 9)]
    b, b2 = args.batch, 2 * args.batch
    print(f"\nbatch scaling of {args.task}: batch {b} (one peer) against {b2} (two peers, perfectly "
          f"synchronised); {args.steps} steps each, eval every {args.every} on {args.eval_samples} "
          f"test samples; {time.perf_counter() - began:.0f} s\n")
    print(f"| eval loss | steps at batch {b} | steps at batch {b2} | ratio | "
          "best 2-peer time / one peer's |")
    print("|---|---|---|---|---|")
    for loss in losses:
        s1, s2 = steps_to(one, loss), steps_to(two, loss)
        if s1 is None or s2 is None:
            print(f"| {loss} | {_fmt(s1)} | {_fmt(s2)} | - | - |")
            continue
        print(f"| {loss} | {s1:.0f} | {s2:.0f} | {s1 / s2:.2f} | {s2 / s1:.2f}x |")
    print(f"\nlast eval loss: {one[-1][1]:.4f} at batch {b}, {two[-1][1]:.4f} at batch {b2}")
    return 0


def _fmt(steps: float | None) -> str:
    return "not reached" if steps is None else f"{steps:.0f}"


if __name__ == "__main__":
    raise SystemExit(main())
