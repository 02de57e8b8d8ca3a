"""Per-round and per-peer views of a job: pure functions of the records a peer holds.

Used by ``ttpeer status`` (through the daemon), the Prometheus endpoint and
``ttpeer report`` (straight from a record log), so all three tell the same story.
Every peer holds every record, so any peer can describe any job.

- ``history``: one row per closed round of the canonical chain: the closer's eval
  loss and task metric, the contributions and peers it combined, and their training
  loss (``train_loss``, weighted by samples). ``advice`` reads overfitting from it.
- ``peer_rows``: one row per member: contributions to the job, samples,
  the time split its contributions report (``_usage``), the precision and
  micro-batch it trains with (its latest contribution's), in the current round
  the shards it claims and the shards its contributions cover, and whether it has
  started the job at all (``started``: a claim, contribution or decline of it).

Claims are shown as their records say (highest attempt per shard, not released,
not yet covered); whether a lease is still live is the protocol's business.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from ttpeer.proto import PRECISION_CODES, Chain, Plan, Record, RecordSet, contributions, covered, train_base

TIME_KEYS = ("train_s", "compute_s", "comm_s", "idle_s", "wall_s")
PRECISIONS = {code: name for name, code in PRECISION_CODES.items()}


def metric_name(close_metrics: dict[str, Any]) -> str:
    return next((k for k in sorted(close_metrics) if k != "eval_loss"), "metric")


def history(rs: RecordSet, chain: Chain) -> list[dict[str, Any]]:
    out = []
    for close in chain.closes:
        metrics = dict(close["metrics"])
        name = metric_name(metrics)
        parts = [rs.by_id[c] for c in close["contribs"] if c in rs.by_id]
        out.append({
            "round": close["round"] + 1, "eval_loss": metrics.get("eval_loss"),
            "eval_metric": metrics.get(name), "metric_name": name,
            "contributions": len(close["contribs"]), "peers": sorted({c.author for c in parts}),
            "state": close["state"], "train_loss": _train_loss(parts),
        })
    return out


def _train_loss(contribs: list[Record]) -> float | None:
    """The round's training loss: its contributions' own (each the mean over the batches
    it trained), weighted by samples; None when any of them did not report one."""
    losses = [(c["metrics"].get("train_loss"), c["samples"]) for c in contribs]
    if not losses or any(loss is None for loss, _ in losses):
        return None
    return round(sum(loss * n for loss, n in losses) / sum(n for _, n in losses), 6)


OVERFIT_ROUNDS = 3  # eval loss rising this many rounds in a row, while train loss falls


def advice(rows: list[dict[str, Any]]) -> str | None:
    """What to change when the closed rounds (``history`` rows) show overfitting: eval loss
    rose in each of the last ``OVERFIT_ROUNDS`` rounds while train loss fell over them.
    A pure function of the closes (and the contributions they name): every peer, the
    status and the report say the same."""
    window = rows[-(OVERFIT_ROUNDS + 1):]
    if len(window) <= OVERFIT_ROUNDS:
        return None
    evals = [r.get("eval_loss") for r in window]
    trains = [r.get("train_loss") for r in window]
    if any(v is None for v in evals + trains):
        return None
    if not (all(b > a for a, b in zip(evals, evals[1:], strict=False)) and trains[-1] < trains[0]):  # type: ignore[operator]
        return None
    return (f"the model is overfitting: eval loss rose for {OVERFIT_ROUNDS} rounds ({evals[0]:.4g} -> "
            f"{evals[-1]:.4g}) while train loss fell ({trains[0]:.4g} -> {trains[-1]:.4g}). Give it more "
            "data (e.g. --task mnist1d:samples=20000), fewer --rounds or --inner-steps, a lower --inner-lr "
            "or a higher --weight-decay")


def _blank(pid: str, name: str) -> dict[str, Any]:
    return {"id": pid, "name": name, "contributions": 0, "used": 0, "shards": 0, "samples": 0,
            "samples_per_s": None, "train_s": 0.0, "compute_s": 0.0, "comm_s": 0.0, "idle_s": 0.0,
            "wall_s": 0.0, "claims": [], "shards_done": 0, "precision": None, "micro_batch": None,
            "started": False}


def peer_rows(rs: RecordSet, job: Record, chain: Chain) -> list[dict[str, Any]]:
    """One row per member of the pool (and per author of a contribution or claim)."""
    names = {pid: m.name for pid, m in rs.members.items()}
    rows: dict[str, dict[str, Any]] = {}

    def row(pid: str) -> dict[str, Any]:
        if pid not in rows:
            rows[pid] = _blank(pid, names.get(pid, pid[:12]))
        return rows[pid]

    for pid in names:  # every member gets a row, also one that has not contributed (yet)
        row(pid)
    # A peer with no claim, contribution or decline in the job yet is still preparing it
    # (loading the task, fetching the initial state): what status shows instead of 0%.
    for kind in ("claim", "contrib", "decline"):
        for r in rs.of_job(job.id, kind):
            row(r.author)["started"] = True
    used = {cid for close in chain.closes for cid in close["contribs"]}
    for c in sorted(rs.of_job(job.id, "contrib"), key=lambda r: r["round"]):
        peer = row(c.author)
        peer["contributions"] += 1
        peer["used"] += c.id in used
        peer["shards"] += len(c["shards"])
        peer["samples"] += c["samples"]
        m = c["metrics"]
        for key in TIME_KEYS:
            peer[key] = round(peer[key] + float(m.get(key, 0.0)), 3)
        if "samples_per_s" in m:
            peer["samples_per_s"] = round(float(m["samples_per_s"]), 1)
        # How the peer trains (train/_recipe.py), as its latest contribution says.
        if "precision" in m:
            peer["precision"] = PRECISIONS.get(int(m["precision"]), "?")
        if "micro_batch" in m:
            peer["micro_batch"] = int(m["micro_batch"])
    if not Plan.of(job, chain.closes).finished(chain.round):
        current = contributions(rs, job, chain.round, train_base(job, chain, chain.round))
        done = covered(current)
        for c in current:
            row(c.author)["shards_done"] += len(c["shards"])
        released = {(r["shard"], r.author, r["attempt"]) for r in rs.of_job(job.id, "release")
                    if r["round"] == chain.round}
        best: dict[int, Record] = {}
        for claim in rs.of_job(job.id, "claim"):
            if claim["round"] != chain.round or claim["shard"] in done:
                continue
            if (claim["shard"], claim.author, claim["attempt"]) in released:
                continue
            old = best.get(claim["shard"])
            if old is None or (claim["attempt"], claim["n"]) > (old["attempt"], old["n"]):
                best[claim["shard"]] = claim
        for shard, claim in sorted(best.items()):
            row(claim.author)["claims"].append(shard)
    return sorted(rows.values(), key=lambda r: (r["name"], r["id"]))


def throughput(rs: RecordSet, job: Record) -> dict[str, list[tuple[int, float]]]:
    """Per peer id: (round + 1, samples per second) of each contribution that reports it."""
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for c in rs.of_job(job.id, "contrib"):
        rate = c["metrics"].get("samples_per_s")
        if rate:
            out[c.author].append((c["round"] + 1, float(rate)))
    return {pid: sorted(points) for pid, points in out.items()}
