"""``scripts/bench/requantize``: does re-quantizing a round's mean cost convergence?

Aggregation slices (issue 15, docs/ARCHITECTURE.md "Aggregation slices") would send each
reduced slice of the round's mean either exact (fp32) or re-quantized like a delta (int8,
4x fewer bytes down). This measures the difference on a real task before the protocol is
built: N simulated peers, one process, each training its own shard of every round with
AdamW from the round's base, its pseudo-gradient int8-encoded with its own error feedback
(as ttpeer does), then the outer Nesterov step on the decoded mean, three ways side by side
from the same start and the same batches:

- ``exact``: the mean as decoded (what the all-deltas path and exact slices apply);
- ``int8``, ``int4``, ``int3`` (``--bits``): the mean encoded again with that many bits and decoded,
  no error feedback (what a reduced slice is sent as);
- ``int8+ef``, ``int4+ef``, ``int3+ef``: the same with an error-feedback residual for the mean (kept by
  whoever reduces it; in the protocol it would have to move with the slice).

It prints the test loss and metric after each ``--every`` rounds, the last round's ratios
against ``exact``, and the bytes: a peer's delta and each mode's encoded mean, averaged over
the rounds (the mean is what every peer downloads once a round in slices, the delta what
it downloads per other peer in the all-deltas path). Plain torch, no daemon: the protocol
is not what is measured.
    scripts/bench/requantize [--task mnist1d] [--peers 8] [--rounds 30] [--steps 20] [--bits 8,4,3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ttpeer.train import decode_delta, encode_delta, init_state, load_task, outer_step, shard_indices
from ttpeer.train._spec import LoadedTask, fetch_batch
from ttpeer.train._state import OuterState


def _inner(task: LoadedTask, base: OuterState, batches: list[list[int]], lr: float) -> dict[str, torch.Tensor]:
    model = task.spec.model()
    model.load_state_dict(base.params, strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for batch in batches:
        x, y = fetch_batch(task.train, batch)
        opt.zero_grad(set_to_none=True)
        task.spec.loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    mine = model.state_dict()
    return {n: base.params[n] - mine[n].detach().float() for n in base.params}


def _evaluate(task: LoadedTask, state: OuterState) -> tuple[float, float]:
    model = task.spec.model()
    model.load_state_dict(state.params, strict=False)
    model.eval()
    with torch.no_grad():
        x, y = fetch_batch(task.test, list(range(task.n_test)))
        out = model(x)
        loss = float(task.spec.loss(out, y))
        metric = float((out.argmax(-1) == y).float().mean()) if out.dim() == 2 else float("nan")
    return loss, metric


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="mnist1d", help="a built-in task or a task file (default: mnist1d; "
                    "the accuracy column is for classifiers, nan otherwise)")
    ap.add_argument("--data", type=Path, default=Path.home() / ".cache" / "ttpeer-bench",
                    help="where built-in tasks cache their data")
    ap.add_argument("--peers", type=int, default=8, help="simulated peers, one shard each per round (default 8)")
    ap.add_argument("--rounds", type=int, default=30, help="outer rounds (default 30)")
    ap.add_argument("--steps", type=int, default=20, help="inner steps per peer per round (default 20)")
    ap.add_argument("--batch", type=int, default=32, help="samples per inner step (default 32)")
    ap.add_argument("--lr", type=float, default=1e-3, help="inner AdamW lr (default 1e-3)")
    ap.add_argument("--every", type=int, default=10, help="print every this many rounds (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and batch order (default 0)")
    ap.add_argument("--bits", default="8,4,3", help="the mean's bits to compare, from 8, 4 and 3 (default 8,4,3)")
    args = ap.parse_args()
    try:
        bits = [int(b) for b in args.bits.split(",")]
    except ValueError:
        bits = []
    if not bits or any(b not in (3, 4, 8) for b in bits):
        ap.error(f"--bits must list some of 8, 4 and 3, got {args.bits!r}")
    for name in ("peers", "rounds", "steps", "batch", "every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    task = load_task(args.task, args.data)
    start = init_state(task, args.seed)
    modes = ["exact"] + [f"int{b}{ef}" for b in bits for ef in ("", "+ef")]
    states = dict.fromkeys(modes, start)
    feedback: dict[str, list] = {m: [None] * args.peers for m in modes}
    mean_feedback: dict[str, dict[str, torch.Tensor] | None] = dict.fromkeys(modes)
    sizes: dict[str, list[int]] = {m: [] for m in ["delta", *modes[1:]]}
    print(f"task {args.task}, {args.peers} peers, {args.rounds} rounds of {args.steps} inner steps")
    print(f"{'round':>5}  " + "  ".join(f"{m + ' loss':>13} {m + ' acc':>12}" for m in modes))
    results: dict[str, tuple[float, float]] = {}
    for rnd in range(args.rounds):
        for mode in modes:
            base = states[mode]
            decoded = []
            for k in range(args.peers):
                batches = shard_indices(task.n_train, args.seed, rnd, k, args.peers, args.steps, args.batch)
                data, feedback[mode][k] = encode_delta(_inner(task, base, batches, args.lr), feedback[mode][k])
                decoded.append((decode_delta(data, base), len(batches) * args.batch))
                if mode == "exact":
                    sizes["delta"].append(len(data))
            if mode == "exact":
                states[mode] = outer_step(base, decoded)
                continue
            mean = outer_step(OuterState({n: torch.zeros_like(t) for n, t in base.params.items()},
                                         {n: torch.zeros_like(t) for n, t in base.params.items()}),
                              decoded, lr=-1.0, momentum=0.0, nesterov=False).params  # 0 + 1 * mean
            data, new_residual = encode_delta(mean, mean_feedback[mode], bits=int(mode[3:].removesuffix("+ef")))
            if mode.endswith("+ef"):
                mean_feedback[mode] = new_residual
            sizes[mode].append(len(data))
            states[mode] = outer_step(base, [(decode_delta(data, base), 1)])
        if (rnd + 1) % args.every == 0 or rnd + 1 == args.rounds:
            results = {m: _evaluate(task, states[m]) for m in modes}
            print(f"{rnd + 1:>5}  " + "  ".join(f"{results[m][0]:>13.4f} {results[m][1]:>12.4f}" for m in modes))
    base_loss = results["exact"][0]
    print("last round, test loss against exact: " + ", ".join(
        f"{m} {results[m][0] / base_loss:.3f}x" for m in modes[1:]))
    delta = sum(sizes["delta"]) / len(sizes["delta"])
    print(f"bytes, mean over rounds: a delta {delta / 1e3:.1f} kB; the encoded mean " + ", ".join(
        f"{m} {sum(sizes[m]) / len(sizes[m]) / 1e3:.1f} kB ({sum(sizes[m]) / len(sizes[m]) / delta:.2f}x)"
        for m in modes[1:]))


if __name__ == "__main__":
    main()
