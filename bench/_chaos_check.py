"""The checkers of a chaos run: what must hold whatever faults it drew.

Each returns the violations it found as sentences (empty: it held):

- ``ended``: the job ended within the bound on every peer that was not removed for good,
  and ended *done* (a fault the pool must survive is no reason to fail); a bad task
  beside it failed, naming its file;
- ``invariants``: from each finished peer's own record log (every frame whole and
  verified), the job's canonical chain has all its rounds, every close's contributions
  cover every shard of its round (I2, fused jobs), and every finished peer holds the same
  chain head and exports the same bytes (I3);
- ``exits``: no process exited that the schedule did not stop, and one it stopped exited
  the way it should have (a revoked daemon with 3, a full disk's with its message);
- ``logs``: no ``Traceback`` in any process's output, no secret (a key of any home in
  hex or base64, an invite token) in any of it.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from ttpeer.daemon.service._integrity import scan_log
from ttpeer.errors import TtpeerError
from ttpeer.proto import RecordSet, canonical_chain, covered, parse
from ttpeer_harness import secrets_of, ttpeer

from ._chaos_run import KILLED, Result
from ._chaos_run import job_status as _job


def ended(res: Result) -> list[str]:
    out: list[str] = []
    if res.error is not None:
        out.append(f"run: {res.error}")
    if res.job is None:
        return out
    for name in res.survivors:
        job = _job(res.homes[name], res.job)
        state = None if job is None else job["state"]
        if state != "done":
            why = "" if job is None or not job.get("ended") else f" ({job['ended']})"
            out.append(f"job on {name}: {state}{why}, not done")
    if res.bad_job is not None:
        out += _broken_job(res)
    return out


def _broken_job(res: Result) -> list[str]:
    """The broken task's job failed for the pool, each reason naming its file. A member
    killed for good never answers, which keeps the job open for the pool (proto/_outcome.py,
    as documented): then it must have failed on every survivor, each naming the file."""
    assert res.bad_job is not None
    silent = [name for name, why in res.exits.items() if why == KILLED]
    out = []
    for name in res.survivors if silent else res.plan.names[:1]:
        job = _job(res.homes[name], res.bad_job)
        if job is None or job["state"] != "failed" or not (silent or job["ended"]):
            out.append(f"the broken task's job on {name} is {None if job is None else job['state']}, "
                       f"not failed{'' if silent else ' for the pool'}")
            continue
        reasons = [r["reason"] for r in job["ended"]["reasons"]] if job["ended"] else [job["declined"] or ""]
        if any("broken_task.py" not in r for r in reasons):
            out.append(f"the broken task's job failed on {name} without naming its file: {reasons}")
    return out


def records_of(home: Path) -> RecordSet:
    """Every record in a home's log, each verified; raises AssertionError on a bad frame."""
    import json

    pool = json.loads((home / "pool.json").read_text())["pool"]
    scan = scan_log((home / "records.log").read_bytes())
    if scan.problem is not None:
        raise AssertionError(f"{home.name}'s record log: {scan.problem} after {len(scan.frames)} records")
    rs = RecordSet(pool=pool)
    for raw in scan.frames:
        rs.add(parse(raw))
    return rs


def invariants(res: Result) -> list[str]:
    if res.job is None:
        return []
    out: list[str] = []
    heads: dict[str, str] = {}
    exports: dict[str, str] = {}
    for name, home in res.homes.items():
        job = _job(home, res.job)
        if job is None or job["state"] != "done":
            continue
        try:
            rs = records_of(home)
        except AssertionError as exc:
            out.append(str(exc))
            continue
        record = rs.by_id.get(res.job)
        if record is None:
            out.append(f"{name} is done with a job its log does not hold")
            continue
        chain = canonical_chain(rs, record)
        if chain.round != job["rounds"]:
            out.append(f"{name}'s chain has {chain.round} closes of {job['rounds']} rounds")
        if record["mode"] == "fused":
            shards = set(range(record["shards"]))
            for rnd, close in enumerate(chain.closes):
                parts = [rs.by_id[c] for c in close["contribs"] if c in rs.by_id]
                if covered(parts) != shards:
                    out.append(f"I2: {name}'s close of round {rnd} covers shards {sorted(covered(parts))}")
        heads[name] = chain.head
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                exports[name] = ttpeer("export", res.job, str(res.root / f"{name}-export.safetensors"),
                                       "--home", str(home))[-1]
            except TtpeerError as exc:
                out.append(f"{name} is done but cannot export: {exc}")
    if len(set(heads.values())) > 1:
        out.append(f"I3: chain heads differ: {heads}")
    if len(set(exports.values())) > 1:
        out.append(f"I3: exports differ: {exports}")
    if not heads and res.survivors:
        out.append("no peer finished the job")
    return out


def exits(res: Result) -> list[str]:
    out = [f"{u} (not by the schedule)" for u in res.unexpected]
    for name, why in res.exits.items():
        log = res.root / f"{name}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        if why == "revoked" and "revoked" not in text:
            out.append(f"{name} was revoked and its log does not say so")
        if why == "revoked" and res.procs_rc.get(name) not in (None, 3):
            out.append(f"{name} was revoked and exited with {res.procs_rc[name]}, not 3")
    for name in res.disk_exits:
        text = (res.root / f"{name}.log").read_text(errors="replace")
        if "No space left" not in text and "disk is full" not in text:
            out.append(f"{name} exited on a full disk without saying the disk is full")
    return out


def logs(res: Result) -> list[str]:
    out: list[str] = []
    secrets = secrets_of([h for h in res.homes.values() if h.exists()], res.tokens)
    for log in sorted(res.root.glob("*.log")):
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            at = text.index("Traceback")
            out.append(f"traceback in {log.name}: {text[at:at + 300]!r}")
        leaked = [what for what, value in secrets.items() if value in text]
        if leaked:
            out.append(f"secret in {log.name}: {', '.join(leaked)}")
    return out


CHECKERS = {"ended": ended, "invariants": invariants, "exits": exits, "logs": logs}


def check(res: Result) -> list[str]:
    """Every violation of the run, each prefixed with its checker's name."""
    return [f"{name}: {v}" for name, fn in CHECKERS.items() for v in fn(res)]
