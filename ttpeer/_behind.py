"""What ``ttpeer status`` and ``ttpeer watch`` say of a peer that is behind its pool or not
training, from a job's row of the status snapshot (``daemon/node/_status.py``). Imports
nothing heavy: both commands answer at once.

Rounds are counted as people count them, from 1: ``round 1/4`` while the first round
trains, ``4/4`` once the job is done (``round_now``); the snapshot's ``round`` counts the
rounds closed."""

from __future__ import annotations

from typing import Any


def round_now(job: dict[str, Any]) -> int:
    """The round a job (a status row) is at, counted from 1: the one in training, or the
    last once every round closed."""
    return min(job["round"] + 1, job["rounds"]) if job["state"] in ("running", "queued") else job["round"]


def behind_lines(job: dict[str, Any]) -> list[str]:
    """What a running fused job's status says of a peer that is behind the pool or not
    training: a laptop on home Wi-Fi among wired machines can spend a job catching up."""
    if job["mode"] != "fused" or job["state"] != "running" or job.get("declined"):
        return []
    out = []
    held, trained, looked = job.get("held_round"), job.get("rounds_trained"), job.get("rounds_looked_at") or 0
    # One round behind is every peer between a close and its apply (and, with overlap,
    # while it trains ahead): two or more is a peer that does not keep up.
    if held is not None and held <= job["round"] - 2:
        out.append(f"catching up: this peer holds round {held}'s model, the pool is at round {round_now(job)} "
                   "(downloading the closes since)")
    if (slow := job.get("slow_link")) is not None:
        mine, median = slow["rate"] * 8 / 1e6, slow["median_rate"] * 8 / 1e6
        out.append(f"slow link: this peer's delta of round {slow['round'] + 1} went up at {mine:.1f} Mbit/s against "
                   f"the pool's median {median:.1f} Mbit/s (encoding and sealing included), so the other peers "
                   "reduce the rounds' slices; a round still waits for this peer's own delta when it trains")
    if trained == 0 and looked >= 3 and job.get("training_shard") is None and not job.get("phase"):
        out.append(f"this peer trained none of the last {looked} rounds: their shards were taken "
                   "before it held each round's model (a slower link than the others'?); longer rounds "
                   "('ttpeer submit --inner-steps N') give it time to join in")
    return out
