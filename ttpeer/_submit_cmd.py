"""``ttpeer submit``: the job record's fields from the command line, checked here, so a
mistake is told at the terminal before the daemon is asked (``submit``); and the defaults
that depend on each other (a fused job sizes its rounds, overlaps them and asks the pool for
its outer step unless the user gives one)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from ttpeer._parser import (
    DEFAULT_BITS,
    DEFAULT_CHUNK,
    DEFAULT_H_MAX,
    DEFAULT_H_MIN,
    chunk_of,
    chunk_values,
    duration,
    positive_int,
    slice_bits_of,
    slice_min_of,
)
from ttpeer._status_cmds import trainable_line
from ttpeer.errors import UsageError

ADAPTER_FILE = "adapter_model.safetensors"  # what peft's save_pretrained writes
MAX_STEP_TIMEOUT = 7 * 86400.0  # the job record's bound
AUTO_FIRST = 25  # an auto-cadence job's first rounds' size (and its budget's unit)
# A fused job's outer step is picked by each close (proto/_outer.py) unless the user gives one;
# a flag given alone takes the other from here (DiLoCo's lr; the momentum that suits 2-8 peers).
FIXED_OUTER_LR, FIXED_OUTER_MOMENTUM = 0.7, 0.7


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """``ttpeer submit``'s flags."""
    s = sub.add_parser("submit", parents=[common], help="submit a training job to the pool")
    s.add_argument("--task", required=True,
                   help="'mnist1d[:samples=N]', 'charlm[:key=int,...]' or a task file path/to/task.py "
                        "(see docs/guide/2-tasks.md)")
    s.add_argument("--mode", choices=["fused", "ensemble"], default="fused",
                   help="fused: one model, periodic averaging; ensemble: --members diverse models that vote")
    s.add_argument("--members", type=positive_int, default=None,
                   help="ensemble: how many members (each on the full data, its own seed and lr/weight decay)")
    s.add_argument("--rounds", type=positive_int, default=10,
                   help="outer rounds (default 10); ensemble: units each member trains")
    s.add_argument("--inner-steps", type=_inner_steps, default=None, metavar="N|auto[:MIN-MAX]",
                   help="inner AdamW steps per shard. auto (fused jobs' default): the pool picks each round's "
                        "steps, as few as keep the sync hidden behind compute (bounds "
                        f"{DEFAULT_H_MIN}-{DEFAULT_H_MAX} unless given), within a budget of --rounds x "
                        f"{AUTO_FIRST} inner steps per shard, so the round count follows the link. N: every "
                        f"round N steps (ensemble: steps per unit, default {AUTO_FIRST})")
    s.add_argument("--shards", type=positive_int, default=None,
                   help="shards per round (default: from the speeds peers publish, 2 per peer at first)")
    s.add_argument("--batch-size", type=positive_int, default=None, help="default: the task's")
    s.add_argument("--inner-lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    s.add_argument("--weight-decay", type=float, default=0.01)
    s.add_argument("--outer-lr", type=float, default=None,
                   help="outer Nesterov SGD lr for every round (default: each round's close picks its outer step "
                        "from how many peers contributed, measured by scripts/bench/convergence; "
                        f"{FIXED_OUTER_LR} when only --outer-momentum is given)")
    s.add_argument("--outer-momentum", type=float, default=None,
                   help="outer Nesterov momentum for every round (default: picked per round, from how many "
                        "peers contributed and how far their deltas agreed, none where they agree; "
                        f"{FIXED_OUTER_MOMENTUM} when only --outer-lr is given)")
    s.add_argument("--bits", type=int, choices=[4, 8], default=DEFAULT_BITS,
                   help=f"bits a delta value is sent in, its rounding error carried into the next delta "
                        f"(default {DEFAULT_BITS}: half the bytes of 8, in the same steps, measured by "
                        "scripts/bench/convergence)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--lease", type=duration, default=None,
                   help="a shard's claim expires this long after its last renewal (default: twice the "
                        "slowest peer's shard time, 15s-5m; 30s before any speed is known)")
    s.add_argument("--no-steal", action="store_true",
                   help="idle peers do not run backup copies of stragglers' shards")
    s.add_argument("--step-timeout", type=duration, default=600.0, metavar="SECONDS",
                   help="a training step that takes longer than this (e.g. 90, 90s, 10m; default 10m) is "
                        "judged hung: its worker is stopped and the job fails on that peer")
    s.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="fused (on by default): train round r+1 while round r's deltas travel, starting from "
                        "this peer's own estimate of round r's result and moving onto the real one as soon as "
                        "it lands; --no-overlap: every round waits for the one before to close (fewer steps to "
                        "a loss, the sync not hidden)")
    s.add_argument("--slices", type=chunk_values, nargs="?", const=DEFAULT_CHUNK, default=None, metavar="VALUES",
                   help="fused: a round of three or more peers closes from aggregation slices: each peer "
                        "reduces one slice of the mean and everyone downloads the reduced slices, so a peer "
                        "receives about one delta and one model a round instead of every other peer's delta. By "
                        "default a round slices only where that saves each peer 1 MiB or more (below it the "
                        "reduction's round trips cost more than the bytes); --slices slices every round it can. "
                        f"VALUES per chunk, a power of two (default {DEFAULT_CHUNK}; a slice is whole chunks, so a "
                        "model needs three chunks for three slices)")
    s.add_argument("--no-slices", action="store_true",
                   help="fused: close every round from all deltas: each peer downloads every other peer's "
                        "delta, n-1 a round (what a pool of two does either way)")
    s.add_argument("--slice-bits", type=int, choices=[3, 4, 8], default=None,
                   help="with slices: the bits a reduced slice is sent in (default 3: 0.31x the bytes of 8, "
                        "0.68x of 4, and no measured loss in scripts/bench/requantize; 4 or 8 if your model's "
                        "loss says otherwise)")
    s.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                   help="autocast of forward/backward (weights, optimizer, deltas stay fp32); default: each "
                        "peer picks, bf16 on a GPU that has it, fp32 elsewhere (CPU bf16 is slower)")
    s.add_argument("--micro-batch", type=positive_int, default=None,
                   help="samples per forward/backward pass, gradients accumulated over the batch (default: "
                        "each peer picks the largest its memory holds)")
    s.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing, for models with gradient_checkpointing_enable()")
    s.add_argument("--lr-schedule", choices=["constant", "cosine", "linear"], default=None,
                   help="inner lr over the job's global inner steps (rounds x inner steps; default constant)")
    s.add_argument("--warmup", type=int, default=None,
                   help="inner steps of linear lr warm-up at the job's start (default 0)")
    s.add_argument("--final-lr-ratio", type=float, default=None,
                   help="cosine/linear: the last step's lr as a fraction of --inner-lr (default 0)")
    s.add_argument("--outer-lr-schedule", choices=["constant", "cosine", "linear"], default=None,
                   help="outer lr over the job's rounds, the same on every peer (default constant)")
    s.add_argument("--outer-warmup", type=int, default=None,
                   help="rounds of linear outer-lr warm-up at the job's start (default 0)")
    s.add_argument("--outer-final-lr-ratio", type=float, default=None,
                   help="outer cosine/linear: the last round's outer lr as a fraction of --outer-lr (default 0)")
    s.add_argument("--init", default=None, metavar="FILE|JOB",
                   help="warm start: a .safetensors state dict of the task's model, or a finished job's "
                        "id (its final model on this peer)")



def _inner_steps(text: str) -> int | tuple[int, int]:
    """``N``, or ``auto`` / ``auto:MIN-MAX`` (the pool picks each round's size within bounds)."""
    t = text.strip().lower()
    if t == "auto":
        return DEFAULT_H_MIN, DEFAULT_H_MAX
    m = re.fullmatch(r"auto:(\d+)-(\d+)", t)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        if not 1 <= lo <= hi <= 1_000_000:
            raise argparse.ArgumentTypeError(f"auto bounds must be 1 <= MIN <= MAX <= 1000000, got {text!r}")
        return lo, hi
    if t.isdigit() and int(t) > 0:
        return int(t)
    raise argparse.ArgumentTypeError(f"not a step count: {text!r} (use e.g. 25, auto, or auto:10-500)")


def submit(args: argparse.Namespace, home: Any) -> int:
    from ttpeer._commands import ask_daemon
    from ttpeer.daemon import control

    task_file = None
    task = args.task
    if task.endswith(".py"):
        path = Path(task)
        try:
            task_file = path.read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read task file {path}: {exc.strerror}") from None
        task = path.name
    elif task.partition(":")[0] not in ("mnist1d", "charlm"):
        raise UsageError(f"unknown task {task!r}: use 'mnist1d' (or 'mnist1d:samples=60000'), 'charlm' "
                         "(or 'charlm:n_layer=4,d_model=128,...') or a path to a task file ending in .py")
    overlap = cadence_defaults(args)
    auto = isinstance(args.inner_steps, tuple)
    steps = min(max(AUTO_FIRST, args.inner_steps[0]), args.inner_steps[1]) if auto else args.inner_steps
    spec: dict[str, Any] = {
        "task": task, "mode": args.mode, "rounds": args.rounds, "shards": args.shards,
        "batches": steps, "batch_size": args.batch_size or 64, "inner_lr": args.inner_lr,
        "weight_decay": args.weight_decay, **outer_fields(args),
        "bits": args.bits, "seed": args.seed, "lease": args.lease, "steal": not args.no_steal,
        "step_timeout": step_timeout(args.step_timeout),
    }
    if args.mode == "ensemble" or args.members is not None:
        if args.mode != "ensemble":
            raise UsageError("--members goes with --mode ensemble")
        if args.members is None:
            raise UsageError("--mode ensemble needs --members M (how many models to train)")
        if args.shards is not None:
            raise UsageError("an ensemble job has one shard per member: leave --shards out")
        spec["members"] = args.members
    if overlap:
        spec["overlap"] = 1
    spec.update(slices_fields(args))
    if auto:
        spec["h_min"], spec["h_max"] = args.inner_steps
    spec.update(recipe_fields(args, home))
    job = ask_daemon(home, control.Submit(spec, task_file), timeout=300)
    if args.mode == "ensemble":
        print(f"submitted ensemble job: {args.members} members x {args.rounds} units x {args.inner_steps} steps, "
              f"lease {job.lease} s")
    elif auto:
        print(f"submitted {args.mode} job: {args.rounds * steps} inner steps per shard x {job.shards} "
              f"shards, in rounds of {args.inner_steps[0]}-{args.inner_steps[1]} steps picked as the link allows "
              f"({steps} at first), lease {job.lease} s")
    else:
        print(f"submitted {args.mode} job: {args.rounds} rounds x {job.shards} shards x "
              f"{args.inner_steps} steps, lease {job.lease} s")
    if job.params and job.trainable is not None:
        print(trainable_line(job.trainable, job.params))
    print(job.job)
    return 0


def cadence_defaults(args: argparse.Namespace) -> bool:
    """Fill in submit's cadence defaults, which depend on the mode and on each other: a fused
    job sizes its rounds (auto) and overlaps them; an ensemble's units are fixed. Returns
    whether the job overlaps."""
    fused = args.mode == "fused"
    if args.inner_steps is None:
        args.inner_steps = (DEFAULT_H_MIN, DEFAULT_H_MAX) if fused else AUTO_FIRST
    if isinstance(args.inner_steps, tuple) and not fused:
        raise UsageError("--inner-steps auto is for fused jobs: an ensemble member trains fixed units")
    if args.overlap and not fused:
        raise UsageError("--overlap is for fused jobs")
    return fused and args.overlap is not False


def outer_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The job's outer step: picked by each close from the pool's size and how far its deltas
    agree (``outer_auto`` 2; the record's lr and momentum are then where the first round's
    estimate starts) unless the user fixed one, or
    the job has no outer step (an ensemble) or lays a schedule over its outer lr."""
    given = args.outer_lr is not None or args.outer_momentum is not None
    if given and args.mode != "fused":
        raise UsageError("--outer-lr and --outer-momentum are for fused jobs: an ensemble's members are not averaged")
    if args.outer_lr is not None and not 0 < args.outer_lr <= 10:
        raise UsageError(f"--outer-lr must be more than 0 and at most 10, got {args.outer_lr:g}")
    if args.outer_momentum is not None and not 0 <= args.outer_momentum < 1:
        raise UsageError(f"--outer-momentum is Nesterov momentum: from 0 to less than 1, got {args.outer_momentum:g}")
    if args.mode == "fused" and not given and args.outer_lr_schedule in (None, "constant"):
        from ttpeer.proto import outer_settings

        first = outer_settings(2, AUTO_FIRST, agree=True)
        return {"outer_lr": first.lr, "outer_momentum": first.momentum, "outer_auto": 2}
    return {"outer_lr": FIXED_OUTER_LR if args.outer_lr is None else args.outer_lr,
            "outer_momentum": FIXED_OUTER_MOMENTUM if args.outer_momentum is None else args.outer_momentum}


def step_timeout(seconds: float) -> float:
    if not 1 <= seconds <= MAX_STEP_TIMEOUT:
        raise UsageError(f"--step-timeout must be between 1 s and 7 days, got {seconds:g} s "
                         "(a number of seconds, or e.g. 90s, 10m, 2h)")
    return seconds


def recipe_fields(args: argparse.Namespace, home: Any) -> dict[str, Any]:
    """The job fields of the precision, micro-batch, schedule and warm-start flags; only
    those given, so a job without them is the record it always was."""
    fields = {"precision": args.precision, "micro_batch": args.micro_batch, "lr_schedule": args.lr_schedule,
              "warmup": args.warmup, "final_lr_ratio": args.final_lr_ratio,
              "outer_lr_schedule": args.outer_lr_schedule, "outer_warmup": args.outer_warmup,
              "outer_final_lr_ratio": args.outer_final_lr_ratio,
              "checkpointing": 1 if args.checkpointing else None}
    out = {k: v for k, v in fields.items() if v is not None}
    if args.micro_batch is not None and args.micro_batch > (args.batch_size or 64):
        raise UsageError(f"--micro-batch ({args.micro_batch}) must not exceed the batch size "
                         f"({args.batch_size or 64}): it is how many of the batch's samples one pass takes")
    if args.init is not None:
        from ttpeer._export import finished_folder

        # The daemon reads the file (it runs on this machine): ``init`` names it until the
        # daemon replaces it with the initial state's hash.
        path = Path(args.init)
        if path.is_dir():  # a peft adapter folder ('ttpeer export --format peft', or any peft save)
            path = path / ADAPTER_FILE
            if not path.is_file():
                raise UsageError(f"--init {args.init} is a folder without {ADAPTER_FILE}: give a peft adapter "
                                 "folder, a .safetensors file or a finished job's id")
        elif not path.is_file() and not args.init.endswith(".safetensors"):
            if not re.fullmatch(r"[0-9a-fA-F]{4,64}", args.init):
                raise UsageError(f"--init {args.init}: no such file, and not a job id; give a .safetensors "
                                 "file, a peft adapter folder or a finished job's id (see 'ttpeer status')")
            path = finished_folder(home, args.init, "--init") / "final.safetensors"
        out["init"] = str(path.absolute())
    return out


def slices_fields(args: argparse.Namespace) -> dict[str, int]:
    """A submitted job's ``chunk`` (values per chunk of its deltas), ``slice_bits`` and, unless
    ``--slices`` was given, ``slice_min`` (``DEFAULT_SLICE_MIN``: a round slices only where
    that saves each peer that many bytes); or nothing (all deltas, unchunked). Fused jobs are
    chunked by default (scripts/bench/exchange: slices pay for deltas of megabytes, and on a
    slow link); a chunked delta decodes to the same values as an unchunked one. Raises
    ``UsageError`` for slice options on an ensemble or that contradict each other."""
    if args.mode != "fused":
        if args.slices is not None or args.slice_bits is not None:
            raise UsageError(f"{'--slices' if args.slices is not None else '--slice-bits'} goes with a fused job "
                             "(an ensemble's members are not averaged)")
        return {}
    chunk = chunk_of(args.slices, args.no_slices)
    bits = slice_bits_of(chunk, args.slice_bits)
    if chunk is None:
        return {}
    least = slice_min_of(args.slices, chunk)
    return {"chunk": chunk, "slice_bits": bits, **({} if least is None else {"slice_min": least})}
