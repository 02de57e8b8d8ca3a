"""Admin actions: submitting a job (and sizing it), revoking a member, cancelling a job,
resolving a peer's name. Each is one signed record made here and handed to the machine;
they run on the trio thread of a running node (``Host``: what they use of it) when the
control socket asks.

What breaks them: a node without the pool key (each waits for it first), or an action
that is not this node's to take (``require_admin``, ``may_cancel``): those raise a
``TtpeerError`` that says who may.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Protocol

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ttpeer.errors import JobError, UsageError
from ttpeer.net import NetError, PoolTransport
from ttpeer.proto import (
    MAX_KEEP,
    DatasetMissing,
    Effect,
    PeerMachine,
    Record,
    RecordError,
    RevokeError,
    TaskSignatureError,
    admitted,
    cancel_of,
    default_sizing,
    job_ended,
    may_cancel,
    mode_named,
    revocation_keep,
    sign,
    sign_task,
)

from .._executor import Executor
from .._home import Home, PoolConfig
from ..data._data import Datasets
from ..sealed._blobs import Blobs
from ..sealed._keys import ended_message

log = logging.getLogger("ttpeer.daemon")
MAX_DATASETS = 64  # a job's datasets (the record's bound): each one fetched at submit at most once

class Host(Protocol):
    """What the admin actions use of the running node (``_node.Node`` is one)."""

    machine: PeerMachine
    me: str
    home: Home
    executor: Executor
    transport: PoolTransport
    blobs: Blobs
    data: Datasets
    node_key: Ed25519PrivateKey
    key_event: trio.Event
    is_admin: bool

    @property
    def cfg(self) -> PoolConfig: ...
    @property
    def pool_keys(self) -> list[bytes]: ...
    def wall(self) -> float: ...
    def now(self) -> float: ...
    def process(self, effects: list[Effect], *, wake: bool = True) -> None: ...
    def rotate_key(self) -> None: ...
    def release_job(self, job: str) -> None: ...
    def liveness(self, peer: str) -> str: ...


async def submit(node: Host, spec: dict[str, Any], task_file: bytes | None) -> Record:
    """Make, seal and publish a new job from ``spec``. ``shards`` or ``lease`` left
    out (None) default from the speeds peers have published. Raises ``TtpeerError``."""
    signed = signed_task(node, task_file) if task_file is not None else None
    await node.key_event.wait()
    spec = sized(node, by_mode(spec))
    for _ in range(4 * MAX_DATASETS + 1):
        try:
            fixed, init = await node.executor.new_job(spec, task_file)
            break
        except DatasetMissing as exc:  # the task reads a dataset this peer does not hold: fetch it
            if exc.pieces:  # read sample by sample: only the pieces it read
                await node.data.fetch(exc.dataset, exc.name, lambda text: log.info("%s", text), None,
                                      pieces=exc.pieces)
            else:
                await node.data.fetch_named(exc.name, whole=exc.whole)
    else:
        raise JobError(f"the task asks for more than {MAX_DATASETS} datasets, or keeps missing their pieces")
    if isinstance(init, Path):  # a model-sized file: sealed and uploaded a piece at a time
        with contextlib.ExitStack() as stack:
            stack.callback(init.unlink, missing_ok=True)
            sealed = stack.enter_context(node.blobs.work_files("submit", "init"))[1]
            init_blob = await node.blobs.put_file(init, sealed)
            node.blobs.keep_state(fixed["init"], init)  # this peer starts from it: no download back
    else:
        init_blob = await node.blobs.put(init)
    task_blob = await node.blobs.put(signed) if signed is not None else ""
    body = {**spec, **fixed, "init_blob": init_blob, "task_blob": task_blob, "at": int(node.wall())}
    rec = sign("job", node.cfg.pool, body, node.node_key)
    node.process(node.machine.add_local(rec, node.now()))
    return rec


def signed_task(node: Host, task_file: bytes) -> bytes:
    """Task files run as Python on every peer: only the pool admin may submit one."""
    if not node.is_admin:
        raise TaskSignatureError(
            "only the pool admin can submit a job with a task file: it runs as Python on every "
            "peer, so it must be signed with the pool's root key. Submit it on the admin machine "
            "(the one that ran 'ttpeer pool create'), or use a built-in task")
    return sign_task(node.home.root_key(), node.cfg.pool, task_file)


def sized(node: Host, spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("shards") is not None and spec.get("lease") is not None:
        return spec
    m = node.machine
    alive = [p for p in m.records.members if node.liveness(p) in ("alive", "unknown")]
    rates = [m.rate if p == node.me else m.peer_rates.get(p, 0.0) for p in alive]
    shards, lease = default_sizing(rates, len(alive), spec["batches"])
    sized = {**spec, "shards": spec.get("shards") or shards, "lease": spec.get("lease") or lease}
    log.info("job sized from published speeds %s: %d shards, lease %.0f s", rates, sized["shards"], sized["lease"])
    return sized


async def revoke(node: Host, peer: str) -> Record:
    """Revoke ``peer``: sign a ``revoke`` record with the root key, rotate the pool key
    to the remaining members, and tell the relay to refuse the peer's sessions.
    Raises ``TtpeerError`` (not the admin, unknown peer, too much to keep)."""
    require_admin(node)
    await node.key_event.wait()
    if peer == node.me:
        raise RevokeError("the admin cannot revoke itself; make a new pool instead")
    rs = node.machine.records
    done = [r for r in rs if r.kind == "revoke" and r["node"] == peer]
    if done and peer not in rs.members:  # already revoked: tell the relay again (it may have lost its disk)
        await node.transport.revoke(done[0].raw)
        return done[0]
    if peer not in rs.members:
        raise RevokeError(f"{peer[:12]} is not a member of this pool (never joined, or lost its invite's race)")
    keep = revocation_keep(rs, peer)
    if len(keep) > MAX_KEEP:
        raise RevokeError(f"the peer's records on the pool's chains are too many to keep ({len(keep)} > "
                          f"{MAX_KEEP}); wait for its jobs to finish, then revoke it")
    rec = sign("revoke", node.cfg.pool, {"node": peer, "keep": keep, "at": int(node.wall())},
               node.home.root_key())
    seal_pub = rs.members[peer].seal
    node.process(node.machine.add_local(rec, node.now()))
    node.rotate_key()
    # Straight to the peer, before the relay stops serving it: its waiting receive
    # returns with the record and it stops at once. Gossip may come too late: once the
    # relay refuses it, only the end of its long poll (RECV_WAIT) would tell it.
    with contextlib.suppress(NetError):
        await node.transport.send(peer, ended_message(peer, seal_pub, [rec]))
    await node.transport.revoke(rec.raw)
    log.info("revoked %s; pool key rotated to epoch %d", peer[:12], len(node.pool_keys) - 1)
    return rec


def find_job(node: Host, prefix: str) -> Record:
    """The job whose id starts with ``prefix``. Raises ``JobError``/``UsageError``."""
    found = [j for j in node.machine.records.jobs() if j.id.startswith(prefix.lower())] if prefix else []
    if not found:
        raise JobError(f"no job {prefix!r} is known to this peer (see 'ttpeer status')")
    if len(found) > 1:
        raise UsageError(f"job prefix {prefix!r} is ambiguous; give more characters")
    return found[0]


async def cancel(node: Host, prefix: str) -> tuple[Record, Record, bool]:
    """End a job for the whole pool with a signed ``cancel`` record: every peer stops
    working on it at once. Only its submitter or the pool's admin may. Returns the job,
    the cancel, and whether it was cancelled already (then the earlier cancel). Raises
    ``JobError``."""
    await node.key_event.wait()
    rs = node.machine.records
    job = find_job(node, prefix)
    if not may_cancel(rs, job, node.me):
        who = rs.members[job.author].name if job.author in rs.members else job.author[:12]
        raise JobError(f"only the job's submitter ({who}) or the pool's admin can cancel job {job.id[:12]}; "
                       "ask one of them")
    if node.machine.plan(job).finished(node.machine.chain(job).round):
        raise JobError(f"job {job.id[:12]} is done; there is nothing to cancel")
    ended = job_ended(rs, job)
    if ended is not None and ended.how == "failed":
        raise JobError(f"job {job.id[:12]} has already failed on every peer; there is nothing to cancel")
    earlier = cancel_of(rs, job)
    if earlier is not None:
        return job, earlier, True
    rec = sign("cancel", node.cfg.pool, {"job": job.id, "at": int(node.wall())}, node.node_key)
    node.process(node.machine.add_local(rec, node.now()))
    node.release_job(job.id)
    log.info("cancelled job %s", job.id[:12])
    return job, rec, False


def require_admin(node: Host) -> None:
    """Raises ``RevokeError`` unless this is the admin: asked before a name is looked
    up, so a member is told what it cannot do rather than which names match."""
    if not node.is_admin:
        raise RevokeError("only the pool admin (the machine that ran 'ttpeer pool create') can revoke a peer")


def resolve_peer(node: Host, text: str) -> tuple[str, str]:
    """(id, name) of a member or revoked node, from its pool-unique name, id, or a
    unique id prefix. Raises ``RevokeError``."""
    names = {n: m.name for n, m in admitted(node.cfg.pool, node.machine.records).items()}
    found = [n for n, name in names.items() if text in (n, name)] or (
        [n for n in names if len(text) >= 6 and n.startswith(text.lower())])
    if len(found) != 1:
        what = "no member" if not found else f"{len(found)} members"
        raise RevokeError(f"{what} of this pool match {text!r}; use a peer id from 'ttpeer status'")
    return found[0], names[found[0]]


def by_mode(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec as its mode completes it (``Mode.complete``: an ensemble's members listed).
    Raises ``UsageError`` for a spec its mode refuses, or a mode that is none."""
    try:
        mode = mode_named(spec.get("mode"))
    except RecordError as exc:
        raise UsageError(str(exc)) from None
    problem = mode.problem(spec)
    if problem is not None:
        raise UsageError(problem)
    return mode.complete(spec)
