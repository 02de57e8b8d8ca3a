"""Ensemble jobs: which members a job trains, fixed at submission.

An ensemble job trains M members, each on the full data, each with its own seed
(initial weights and data order) and a hyper-parameter variant (learning rate and
weight decay around the job's). The list is a pure function of the job's seed and
settings, written into the job record so every peer, and anyone reading the
record later, sees exactly what each member was.

In the ledger a member is a shard and a round is one unit of training (the job's
``inner_steps``): a contribution is that member's new checkpoint, and a close
gathers every member's checkpoint into the ensemble state of the next round.
"""

from __future__ import annotations

# Learning-rate and weight-decay multipliers, walked in step so neighbouring members
# differ in both. Rotated by the job seed: different seeds give different line-ups.
LR_FACTORS = (1.0, 0.5, 2.0, 0.7, 1.4, 0.35)
WD_FACTORS = (1.0, 0.0, 2.0, 0.5)
_MASK = (1 << 64) - 1


def member_variants(seed: int, count: int, lr: float, weight_decay: float) -> list[dict[str, int | float]]:
    """The ``count`` members of an ensemble job with this seed and base lr / weight decay:
    ``[{"seed", "lr", "weight_decay"}, ...]``. Raises ValueError for ``count`` < 1."""
    if count < 1:
        raise ValueError(f"an ensemble needs at least one member, got {count}")
    out: list[dict[str, int | float]] = []
    for i in range(count):
        k = seed + i
        out.append({
            "seed": _mix(seed * 1_000_003 + i) % 2**31,
            "lr": float(f"{lr * LR_FACTORS[k % len(LR_FACTORS)]:.6g}"),
            "weight_decay": float(f"{weight_decay * WD_FACTORS[k % len(WD_FACTORS)]:.6g}"),
        })
    return out


def _mix(x: int) -> int:
    # SplitMix64's finaliser: spreads consecutive inputs over the whole range.
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)
