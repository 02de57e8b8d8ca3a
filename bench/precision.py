"""``scripts/bench/precision``: inner steps per second, fp32 against bf16 (and fp16),
and ttpeer's inner loop against a bare torch loop of the same model and batch.

The bare loop is what a user would write by hand: fetch the batch, forward and loss
under autocast, backward, clip to norm 1, AdamW step. ttpeer's loop
(``InnerTrainer.train_shard``) does the same work plus what it needs: the lr of the
job's schedule at each global step (constant here, so both loops do the same
arithmetic), micro-batch splitting, a divergence check kept on the device. Both
train from the same initial weights on the same batches, and the last column says
whether they ended on the same weights (they should: the same work); runs
alternate between the two and the best of ``--repeats`` is kept, so a noisy shared
machine penalises neither side; on the CPU the time is the process's CPU time
(use ``--threads 1`` there, or CPU time adds up over threads).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from ttpeer.train import InnerTrainer, LrSchedule, Recipe, init_state, load_task, shard_indices
from ttpeer.train._inner import GRAD_CLIP
from ttpeer.train._precision import autocast
from ttpeer.train._spec import LoadedTask, fetch_batch

Loop = Callable[[Sequence[Sequence[int]]], None]


def _bare(task: LoadedTask, precision: str, device: torch.device, seed: int) -> tuple[Loop, nn.Module]:
    model = task.spec.model().to(device)
    model.load_state_dict(init_state(task, seed).params, strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def run(batches: Sequence[Sequence[int]]) -> None:
        model.train()
        for batch in batches:
            x, y = fetch_batch(task.train, batch)
            with autocast(precision, device):
                loss = task.spec.loss(model(x.to(device)), y.to(device))
            opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
                opt.step()

    return run, model


def _ttpeer(task: LoadedTask, precision: str, device: torch.device, seed: int, steps: int) -> tuple[Loop, nn.Module]:
    schedule = LrSchedule("constant", total=100 * steps)
    trainer = InnerTrainer(task, device=str(device), seed=seed, recipe=Recipe(precision=precision, schedule=schedule))
    trainer.start(init_state(task, seed))

    def run(batches: Sequence[Sequence[int]]) -> None:
        trainer.train_shard(batches)

    return run, trainer.model


def _rate(run: Loop, batches: list[list[int]], device: torch.device) -> float:
    # On the CPU, this process's CPU time: other work on a shared machine stretches the wall
    # clock of whichever loop it happens to overlap. On a GPU, the wall clock after a sync.
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    began = clock()
    run(batches)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(batches) / (clock() - began)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="mnist1d,charlm", help="comma-separated task specs (default mnist1d,charlm)")
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated, of fp32,bf16,fp16 (default fp32,bf16)")
    p.add_argument("--steps", type=int, default=40, help="timed inner steps per run (default 40)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each loop; the best counts (default 5)")
    p.add_argument("--batch-size", type=int, default=None, help="default: the task's")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--data", type=Path, default=Path.home() / ".cache" / "ttpeer-bench", help="built-in task data")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"device {device} ({name}), torch {torch.__version__}; steps/s, best of {args.repeats} x {args.steps} steps")
    print(f"{'task':<28} {'precision':<9} {'bare torch':>11} {'ttpeer':>9} {'ttpeer/bare':>12} {'vs fp32':>8} "
          f"{'same weights':>13}")
    for spec in args.tasks.split(","):
        task = load_task(spec, args.data)
        batch = args.batch_size or task.batch_size
        batches = shard_indices(task.n_train, 0, 0, 0, 1, args.steps, batch)
        fp32_rate = None
        for precision in args.precisions.split(","):
            built = {"bare": _bare(task, precision, device, 0),
                     "ttpeer": _ttpeer(task, precision, device, 0, args.steps)}
            loops = {key: run for key, (run, _model) in built.items()}
            for run in loops.values():  # warm-up: allocator, kernels, autocast caches
                _rate(run, batches[:3], device)
            best = {k: 0.0 for k in loops}
            for repeat in range(args.repeats):
                order = list(loops) if repeat % 2 == 0 else list(loops)[::-1]  # neither always goes first
                for key in order:
                    best[key] = max(best[key], _rate(loops[key], batches, device))
            fp32_rate = best["ttpeer"] if precision == "fp32" else fp32_rate
            ratio = f"{best['ttpeer'] / fp32_rate:.2f}x" if fp32_rate else "-"
            bare, ours = (dict(model.named_parameters()) for _run, model in built.values())
            same = "yes" if all(torch.equal(p, ours[n]) for n, p in bare.items()) else "no"
            print(f"{spec + f' (batch {batch})':<28} {precision:<9} {best['bare']:>11.1f} {best['ttpeer']:>9.1f} "
                  f"{best['ttpeer'] / best['bare']:>11.3f}x {ratio:>8} {same:>13}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
