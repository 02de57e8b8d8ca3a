"""The status snapshot: one JSON object, the schema documented in docs/guide/7-watching.md.

    {"version": 1, "node": {...}, "relay": {...}, "bytes_sent", "bytes_received",
     "gossip": {"digests_out", "digests_in", "records_out", "answers_out", "records_in_new",
                "records_in_held"},
     "peers": [{"id", "name", "role", "self", "last_seen_s", "liveness", "rate", "provisional"}],
     "jobs": [{"id", "task", "mode", "state", "round", "rounds", "shards_done",
               "shards_total", "eval_loss", "eval_metric", "metric_name",
               "bytes_sent", "bytes_received", "compression_ratio", "declined",
               "state_hash", "held_round", "rounds_trained", "rounds_looked_at", "exchange",
               "spot_checks", "slow_link",
               "training_shard", "wasted_batches", "duplicate_fraction",
               "declines": [{"peer", "name", "reason", "need_bytes", "have_bytes", "code"}],
               "ended": null | {"how", "by": {"peer", "name"} | null,
                                "reasons": [{"peer", "name", "reason"}]}, "phase",
               "data": null | [{"name", "id", "bytes", "pieces", "pieces_here", "here",
                                "fetched_bytes", "direct_bytes", "bad_pieces"}],
               "data_wait": null | {"waits", "seconds", "first_s"}}]}

``phase`` says what this peer is doing before it can train a running job ("loading the
task and its data, checking it fits", "fetching the initial state"...), null otherwise.

``data`` lists the datasets a job's task reads (``ttpeer.train.dataset_path``): how much
of each this peer holds (``pieces_here``; ``here``: "added", "fetched", "partial" or "no"),
how many bytes it fetched, and how many pieces it refused as damaged (fetched again).
``data_wait``: how often this peer's shards waited for pieces of a dataset read sample by
sample, the seconds in all, and the first wait's.

``held_round`` (fused jobs) is the newest round whose model this peer holds: one below
``round`` between a close and its apply, two or more below on a peer that does not keep
up (``ttpeer status`` says it is catching up). ``rounds_trained`` counts, of the last
``rounds_looked_at`` closed rounds (``TRAINED_LOOKBACK`` once there are), those whose close used this peer's
work (0 of 3 on a running peer: it is not training, e.g. its link is too slow to hold
each round's model before its shards go). ``slow_link`` (sliced fused jobs) is null, or
``{"round", "rate", "median_rate"}`` when the newest of those rounds that used this peer's
work judged its link slow (its delta went up at ``rate`` bytes a second against the
authors' median): the other authors reduce the round's slices first. ``exchange`` (fused
jobs) is ``{"bits", "chunk", "slice_bits", "slices_from", "last_slices"}`` (``exchange``).
``spot_checks`` (fused jobs) is ``{"reproduced", "missed"}``: the other peers' reduced
slices this peer checked on one chunk, and of those, the ones whose chunk came out
otherwise here (it then reduced the whole slice and published its own).

``declined`` is this peer's own reason for sitting a job out; ``declines`` lists every
peer whose decline stands (``need_bytes``/``have_bytes`` are 0 unless memory was why);
``ended`` says how a job ended for the whole pool, if it did (``proto.job_ended``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import trio

from ttpeer.proto import (
    FUSED,
    GOSSIP_TRAFFIC,
    SLICES_FROM,
    Chain,
    JobSpec,
    PeerMachine,
    Record,
    RecordSet,
    close_outer,
    contributions,
    covered,
    failed_here,
    job_ended,
    joined_after,
    slow_link_of,
    standing_declines,
    train_base,
)

from .._counters import JobStats, Touches
from .._home import PoolConfig
from ._replay import ReplayGuard

SCHEMA_VERSION = 1


class CountersView(Protocol):
    @property
    def started(self) -> float: ...
    @property
    def peers_seen(self) -> Mapping[str, float]: ...
    @property
    def jobs(self) -> Mapping[str, JobStats]: ...
    @property
    def relay_ok(self) -> bool: ...
    @property
    def last_error(self) -> str: ...
    @property
    def rejected(self) -> Mapping[str, int]: ...
    @property
    def touches(self) -> Touches: ...


class NodeView(Protocol):
    """What a snapshot reads of a running node, read-only: ``_node.Node`` is one. A
    protocol rather than ``Node`` itself, so that this module does not import the node
    that imports it."""

    @property
    def machine(self) -> PeerMachine: ...
    @property
    def me(self) -> str: ...
    @property
    def cfg(self) -> PoolConfig: ...
    @property
    def counters(self) -> CountersView: ...
    @property
    def pool_key(self) -> bytes | None: ...
    @property
    def pool_keys(self) -> Sequence[bytes]: ...
    @property
    def replay(self) -> ReplayGuard: ...
    @property
    def finished(self) -> Mapping[str, str]: ...
    @property
    def phases(self) -> Mapping[str, str]: ...
    @property
    def bytes_sent(self) -> int: ...
    @property
    def bytes_received(self) -> int: ...
    def liveness(self, peer: str) -> str: ...
    def job_data(self, job: Record) -> list[dict[str, Any]] | None: ...


def duplicate_fraction(records: RecordSet, job: Record, chain: Chain) -> float | None:
    """Of the samples in contributions to closed rounds, the share no close used:
    backup copies that lost the race, and work on shards someone else covered first."""
    used = {cid for close in chain.closes for cid in close["contribs"]}
    total = wasted = 0
    for c in records.of_job(job.id, "contrib"):
        if c["round"] < chain.round and c["base"] == chain.states[c["round"]]:
            total += c["samples"]
            wasted += 0 if c.id in used else c["samples"]
    return round(wasted / total, 4) if total else None


def held_round(chain: Chain, held: set[str]) -> int | None:
    """The newest round whose model this peer holds (``chain.states[r]``), or None: a peer
    a round or more behind the chain's head is catching up (downloading the closes since)."""
    return max((r for r, s in enumerate(chain.states) if s in held), default=None)


TRAINED_LOOKBACK = 3  # rounds: ``status`` says when a running peer trained none of the last ones


def rounds_trained(records: RecordSet, chain: Chain, me: str, last: int = TRAINED_LOOKBACK) -> int:
    """Of the chain's last ``last`` closed rounds, those whose close used a contribution of
    ``me``: a peer at 0 of several rounds is in the pool but not training (a link too slow
    to reach each round's model before its shards are taken, say)."""
    return sum(1 for close in chain.closes[-last:] if any(
        c in records.by_id and records.by_id[c].author == me for c in close["contribs"]))


def exchange(job: Record, chain: Chain) -> dict[str, Any]:
    """How a fused job's rounds move: its deltas' ``bits``; ``chunk`` (values a chunk) and
    ``slice_bits`` when rounds of ``slices_from`` (``SLICES_FROM``) or more authors close
    from reduced slices, else null, and ``slice_min`` (bytes slices must save each peer a
    round, null: none); ``last_slices``: the slices the newest close named (0:
    it closed from all deltas; null before the first close); ``outer``: the outer step of
    the newest close, ``{"lr", "momentum", "contributions", "picked"}`` (``picked``: the close
    chose it, ``outer_auto``; else the job's own, its ``schedule`` the job's outer-lr
    schedule), null before the first close."""
    spec = JobSpec.of(job)
    last = chain.closes[-1] if chain.closes else None
    step = None
    if last is not None:
        picked = close_outer(last)
        lr, momentum = picked if picked is not None else (spec.outer_lr, spec.outer_momentum)
        step = {"lr": lr, "momentum": momentum, "contributions": len(last["contribs"]), "picked": picked is not None,
                "schedule": job.body.get("outer_lr_schedule", "constant")}
    return {"bits": spec.bits, "chunk": spec.chunk, "slice_bits": spec.slice_bits if spec.chunk else None,
            "slice_min": spec.slice_min, "slices_from": SLICES_FROM,
            "last_slices": None if last is None else len(last.body.get("slices", ())),
            "outer": step}


def slow_link(records: RecordSet, job: Record, chain: Chain, me: str,
              last: int = TRAINED_LOOKBACK) -> dict[str, Any] | None:
    """Whether this peer reduces no slices first because its link was judged slow
    (``proto.slow_link_of``), in the newest of the chain's last ``last`` sliced closes that
    used its work: that round, and its upload rate and the pool's median in bytes a second.
    None when it was not judged slow there, or no such close is recent."""
    spec = JobSpec.of(job)
    for close in reversed(chain.closes[-last:]):
        cover = [records.by_id[c] for c in close["contribs"] if c in records.by_id]
        if "slices" not in close.body or me not in {c.author for c in cover}:
            continue
        found = slow_link_of(spec, cover, me)
        if found is None:
            return None
        return {"round": close["round"], "rate": round(found[0]), "median_rate": round(found[1])}
    return None


def declines(records: RecordSet, job: Record) -> list[dict[str, Any]]:
    """The members that sit ``job`` out and why, by name: their standing declines
    (``proto.standing_declines``: a peer that contributed after a decline for anything but
    a failure of the task, say restarted with more memory, is no longer listed)."""
    members = records.members
    out = [{"peer": r.author, "name": members[r.author].name, "reason": r["reason"],
            "need_bytes": r["need"], "have_bytes": r["have"], "code": r.body.get("code")}
           for r in standing_declines(records, job).values() if r.author in members]
    return sorted(out, key=lambda d: (d["name"], d["peer"]))


def ended(records: RecordSet, job: Record) -> dict[str, Any] | None:
    """How ``job`` ended for the whole pool (``proto.job_ended``), with names for people."""
    end = job_ended(records, job)
    if end is None:
        return None
    members = records.members

    def name(peer: str) -> str:
        return members[peer].name if peer in members else peer[:12]

    return {"how": end.how, "by": {"peer": end.by, "name": name(end.by)} if end.by else None,
            "reasons": [{"peer": p, "name": name(p), "reason": r} for p, r in end.reasons]}


def snapshot(node: NodeView) -> dict[str, Any]:
    m = node.machine
    now = trio.current_time()
    peers = []
    unacked = m.records.provisional
    for pid, member in sorted(m.records.members.items(), key=lambda kv: kv[1].name):
        seen = node.counters.peers_seen.get(pid)
        peers.append({
            "id": pid, "name": member.name, "role": member.role, "self": pid == node.me,
            "last_seen_s": 0.0 if pid == node.me else (round(now - seen, 1) if seen is not None else None),
            "liveness": node.liveness(pid),
            "rate": round(m.rate if pid == node.me else m.peer_rates.get(pid, 0.0), 3),
            # Its join is not acknowledged by the admin yet (``RecordSet.provisional``).
            "provisional": pid in unacked,
        })
    jobs = []
    me = m.records.members.get(node.me)  # its name in the pool: unique, may differ from the chosen one
    active = m.active_job()
    for job in m.records.jobs():
        chain, plan = m.chain(job), m.plan(job)
        last = dict(chain.closes[-1]["metrics"]) if chain.closes else {}
        metric_name = next((k for k in last if k != "eval_loss"), "metric")
        over = plan.finished(chain.round)
        end = ended(m.records, job) if not over else None  # a finished job is done
        if over and job.id not in m.done_jobs and joined_after(m.records, job, node.me):
            state = "skipped"  # it had finished before this peer joined (``proto.joined_after``)
        elif over and job.id not in m.declined:
            # Done once this peer wrote the final model (export reads it), not before.
            finished = m.done_jobs.get(job.id) == chain.head == node.finished.get(job.id)
            state = "done" if finished else "finishing"
        elif end is not None:
            state = end["how"]  # "failed" (for the whole pool) or "cancelled"
        elif failed_here(m.records, job, node.me) is not None:
            state = "failed"  # here; the others may finish it
        elif job.id in m.declined:
            state = "declined"
        elif active is not None and active.id == job.id:
            state = "running"
        else:
            state = "queued"
        done = 0
        if not over:
            done = len(covered(contributions(m.records, job, chain.round, train_base(job, chain, chain.round))))
        stats = node.counters.jobs.get(job.id)
        ratio = stats.ratio() if stats else None
        spec = JobSpec.of(job)
        fused = spec.mode is FUSED  # rounds of deltas: what a round held, used and exchanged
        jobs.append({
            "id": job.id, "task": spec.task, "mode": spec.mode.name, "state": state,
            "round": min(chain.round, plan.expected_rounds()), "rounds": plan.expected_rounds(),
            # The round's inner steps per shard; ``auto``: the pool picks them (``Plan``).
            "inner_steps": plan.inner_steps(chain.round), "auto": plan.auto,
            "shards_done": done if state == "running" else (spec.shards if state != "queued" else 0),
            "shards_total": spec.shards, "lease_s": spec.lease,
            "eval_loss": last.get("eval_loss"), "eval_metric": last.get(metric_name),
            "metric_name": metric_name,
            # The model's parameters, and how many train (fewer with LoRA adapters); None: an older job.
            "params": spec.params, "trainable": spec.trainable,
            "bytes_sent": node.bytes_sent, "bytes_received": node.bytes_received,
            "compression_ratio": ratio, "declined": m.declined.get(job.id),
            "state_hash": chain.head,
            # Fused: the newest round whose model this peer holds, and how many of the last
            # TRAINED_LOOKBACK closed rounds used its work (status says when it is behind).
            "held_round": held_round(chain, m.held) if fused else None,
            "rounds_trained": rounds_trained(m.records, chain, node.me) if fused else None,
            "rounds_looked_at": min(TRAINED_LOOKBACK, chain.round) if fused else None,
            "exchange": exchange(job, chain) if fused else None,
            "spot_checks": None if not fused else {
                "reproduced": stats.samples if stats else 0, "missed": stats.sample_misses if stats else 0},
            # A sliced job: this peer's link judged slow in a recent round (it reduces last).
            "slow_link": slow_link(m.records, job, chain, node.me) if fused else None,
            "training_shard": m.training[2] if m.training and m.training[0] == job.id else None,
            "wasted_batches": m.wasted_batches if active is not None and active.id == job.id else 0,
            "duplicate_fraction": duplicate_fraction(m.records, job, chain),
            "declines": declines(m.records, job), "ended": end,
            "phase": node.phases.get(job.id) if state == "running" else None,
            "data": node.job_data(job),
            # Shards that waited for dataset pieces (``dataset_samples``): see ``JobStats``.
            "data_wait": None if not stats or not stats.data_waits else {
                "waits": stats.data_waits, "seconds": round(stats.data_wait_s, 3),
                "first_s": round(stats.first_data_wait_s or 0.0, 3)},
        })
    return {
        "version": SCHEMA_VERSION,
        "node": {"id": node.me, "name": me.name if me is not None else node.cfg.name, "pool": node.cfg.pool,
                 "has_pool_key": node.pool_key is not None, "uptime_s": round(now - node.counters.started, 1),
                 "key_epoch": len(node.pool_keys) - 1 if node.pool_keys else None,
                 "replays_dropped": node.replay.dropped},
        "relay": {"url": node.cfg.relays[0], "connected": node.counters.relay_ok,
                  "last_error": node.counters.last_error or None, "rejected": dict(node.counters.rejected),
                  "touches": dataclasses.asdict(node.counters.touches)},
        "bytes_sent": node.bytes_sent, "bytes_received": node.bytes_received,
        "gossip": {k: node.machine.gossip_traffic.get(k, 0) for k in GOSSIP_TRAFFIC},
        "peers": peers, "jobs": jobs,
    }
