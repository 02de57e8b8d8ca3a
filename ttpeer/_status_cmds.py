"""The client commands that ask the running daemon: ``ttpeer status`` and ``ttpeer
wait``. They import neither torch nor trio: they answer at once."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ttpeer._behind import behind_lines, round_now
from ttpeer._figures import count as count_text
from ttpeer._figures import size as _size
from ttpeer._parser import duration, positive_int
from ttpeer.errors import JobError, UsageError


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    st = sub.add_parser("status", parents=[common], help="peers, jobs, progress")
    st.add_argument("--json", action="store_true", help="one JSON object (schema: docs/guide/7-watching.md)")
    st.add_argument("--watch", action="store_true", help="redraw live progress per peer and per round (Ctrl-C)")
    st.add_argument("--interval", type=float, default=1.0, help="seconds between redraws (default 1)")
    st.add_argument("--frames", type=positive_int, default=None, help=argparse.SUPPRESS)  # tests: stop after N
    w = sub.add_parser("wait", parents=[common], help="wait until a job is done",
                       epilog="exit status: 0 done on every peer that started it; 4 done, but peers failed "
                              "it (named, with why); 1 declined, failed or cancelled; 2 timed out")
    w.add_argument("job", help="job id or a unique prefix")
    w.add_argument("--timeout", type=duration, default=None, help="give up after this long (exit 2)")
    w.add_argument("--json", action="store_true",
                   help="one JSON line at the end: state, metric and the peers that failed the job")


def _status_obj(home: Any) -> dict[str, Any]:
    from ttpeer._commands import ask_daemon
    from ttpeer.daemon import control

    return ask_daemon(home, control.Status()).status


def status(args: argparse.Namespace, home: Any) -> int:
    """``ttpeer status [--json | --watch]``."""
    if args.watch:
        from ttpeer._commands import check_interval, watch

        return watch(home, check_interval(args.interval), args.frames)
    st = _status_obj(home)
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    node = st["node"]
    relay = "connected" if st["relay"]["connected"] else f"NOT connected ({st['relay']['last_error']})"
    print(f"node {node['name']} ({node['id'][:12]}) pool {node['pool'][:12]}  relay {relay}")
    print(f"bytes sent {_size(st['bytes_sent'])}, received {_size(st['bytes_received'])}"
          + (f"; metrics at {st['metrics_url']}" if st.get("metrics_url") else ""))
    relays = st.get("relays") or []
    if len(relays) > 1:
        print("relays: " + ", ".join(f"{r['url']} ({r['state'] or 'not connected'}"
                                      + (", primary" if r["primary"] else "")
                                      + (f": {r['error']}" if r["error"] and r["state"] != "live" else "") + ")"
                                      for r in relays))
    direct = st.get("direct")
    if direct and direct["addrs"]:
        blobs = direct.get("served_blobs", 0)
        print(f"direct: serving at {', '.join(direct['addrs'])}, {direct['served_pieces']} pieces "
              f"({_size(direct['served_bytes'])}) served"
              + (f", {blobs} deltas and states ({_size(direct['served_blob_bytes'])})" if blobs else "")
              + (f", {direct['refused']} requests refused" if direct["refused"] else ""))
    if direct and direct.get("fetched_blob_bytes"):
        print(f"direct: {_size(direct['fetched_blob_bytes'])} of deltas and states fetched from members directly")
    for repair in st.get("startup_repairs") or []:
        print(f"repaired at start-up: {repair}")
    print("peers:")
    running = [j for j in st["jobs"] if j["state"] == "running"]
    silent = {p["id"] for p in st["peers"] if _silent(p, running)}
    # Peers that may be preparing a job: heard from, and not silent since.
    heard = {p["id"] for p in st["peers"] if p["last_seen_s"] is not None and p["id"] not in silent}
    for peer in st["peers"]:
        seen = "this machine" if peer["self"] else (
            "never heard from" if peer["last_seen_s"] is None else f"heard {peer['last_seen_s']:.0f}s ago")
        if peer["id"] in silent:
            seen = silent_line(peer["last_seen_s"], running[0] if running else None)
        if peer.get("provisional"):
            seen += "; provisional: the admin has not acknowledged its join yet (it does when it next runs)"
        print(f"  {peer['name']:<16} {peer['id'][:12]}  {peer['role']:<6}  {seen}")
    print("jobs:" if st["jobs"] else "jobs: none")
    for job in st["jobs"]:
        metric = "" if job["eval_loss"] is None else (
            f"  eval loss {job['eval_loss']:.4f} {job['metric_name']} {job['eval_metric']:.4f}")
        compressed = job["compression_ratio"] is not None and job["mode"] != "ensemble"  # whole checkpoints
        ratio = f"  compression {job['compression_ratio']:.1f}x" if compressed else ""
        use = "" if job.get("utilization") is None else f"  utilization {100 * job['utilization']:.0f}%"
        unit, parts = ("unit", "members") if job["mode"] == "ensemble" else ("round", "shards")
        of = f"~{job['rounds']}" if job.get("auto") and job["state"] != "done" else f"{job['rounds']}"
        size = f" ({job['inner_steps']} inner steps, sized to the link)" if job.get("auto") else ""
        print(f"  {job['id'][:12]} {job['task']} {job['mode']} {job['state']}: {unit} {round_now(job)}/"
              f"{of}{size}, {parts} {job['shards_done']}/{job['shards_total']}{metric}{ratio}{use}")
        if job["state"] == "skipped":
            print(f"    {_SKIPPED}")
        if job.get("phase"):
            print(f"    preparing here: {job['phase']}")
        if job.get("params") and job["trainable"] < job["params"]:
            print(f"    adapters: {trainable_line(job['trainable'], job['params'])}")
        if job.get("exchange"):
            print(f"    {exchange_line(job['exchange'])}")
        checks = spot_check_line(job.get("spot_checks"))
        if checks:
            print(f"    {checks}")
        for line in behind_lines(job):
            print(f"    {line}")
        for d in job.get("data") or []:
            how = {"added": "added here", "no": "none fetched yet"}.get(
                d["here"], f"fetched {_size(d['fetched_bytes'])}")
            if d["here"] == "partial":  # read sample by sample: the pieces of the shards trained here
                how = f"fetched {_size(d['fetched_bytes'])} (the pieces its shards read)"
            refused = f", {d['bad_pieces']} refused and fetched again" if d["bad_pieces"] else ""
            print(f"    data: {d['name']} ({d['id'][:12]}) {d['pieces_here']}/{d['pieces']} pieces of "
                  f"{_size(d['bytes'])} here, {how}{refused}")
        if job.get("data_wait"):
            w = job["data_wait"]
            later = w["seconds"] - w["first_s"]
            print(f"    shards waited for data {w['waits']} times: {w['first_s']:.1f} s the first"
                  + (f", {later:.1f} s after it (prefetch did not keep up)" if w["waits"] > 1 else ""))
        if job.get("advice"):
            print(f"    {job['advice']}")
        waiting = [p["name"] for p in job.get("peers") or [] if not p.get("started", True) and p["id"] in heard]
        if waiting and job["state"] == "running":
            print(f"    not started yet (preparing the job): {', '.join(waiting)}")
        end = job.get("ended")
        if end and end["by"]:
            print(f"    cancelled by {end['by']['name']} ({end['by']['peer'][:12]})")
        for decline in job.get("declines") or []:
            mine = decline["peer"] == node["id"]
            if decline.get("code") == "failed":  # the task's code failed there
                who = "here" if mine else f"on {decline['name']} ({decline['peer'][:12]})"
                print(f"    failed {who}: {decline['reason']}")
            else:
                who = "here" if mine else f"by {decline['name']} ({decline['peer'][:12]})"
                print(f"    declined {who}: {decline['reason']}")
        if job["declined"] and not any(d["peer"] == node["id"] for d in job.get("declines") or []):
            print(f"    declined here: {job['declined']}")
        how = [f"{p['name']} {p['precision']} micro-batch {p['micro_batch']}" for p in job.get("peers") or []
               if p.get("precision")]
        if how:
            print(f"    training: {', '.join(how)}")
        for w in (x for x in st.get("workers") or [] if x["job"] == job["id"]):
            restarts = f", restarted {w['deaths']}x" if w["deaths"] else ""
            print(f"    worker {w['rank']}: pid {w['pid']} on {w['device']}{restarts}")
    return 0


def _silent(peer: dict[str, Any], running: list[dict[str, Any]]) -> bool:
    """Not heard from for longer than the running job's lease, or for long enough that
    the daemon suspects it (it misses its digests, the pool's heartbeat)."""
    if peer["self"] or peer["last_seen_s"] is None:
        return False
    lease = min((j["lease_s"] for j in running if j.get("lease_s")), default=None)
    return peer.get("liveness") in ("suspect", "dead") or (lease is not None and peer["last_seen_s"] > lease)


def silent_line(silent_s: float, job: dict[str, Any] | None) -> str:
    """``silent since 08:51:02 (16s): ...`` and what becomes of its work, in ``job`` (a
    running job's status entry) if there is one. Its claims lapse ``lease_s`` after it was
    last heard (``proto`` leases), and the other peers train those shards."""
    since = time.strftime("%H:%M:%S", time.localtime(time.time() - silent_s))
    head = f"silent since {since} ({silent_s:.0f}s)"
    if job is None:
        return head + "; no job is running"
    left = job["lease_s"] - silent_s
    if left > 0:
        return head + f": if it stays silent, the shards it claimed go back to the pool in {left:.0f}s"
    return head + f": the shards it claimed went back to the pool {-left:.0f}s ago (its {job['lease_s']:g}s lease)"


def trainable_line(trainable: int, params: int) -> str:
    """``trainable 42.0M of 7.6B parameters (0.55%)``, or the count when all of them train."""
    if trainable >= params:
        return f"trains all {count_text(params)} parameters of the model"
    return f"trainable {count_text(trainable)} of {count_text(params)} parameters ({100 * trainable / params:.2f}%)"


def exchange_line(ex: dict[str, Any]) -> str:
    """What ``ttpeer status`` says of a fused job's exchange (the status JSON's ``exchange``)."""
    head = f"exchange: {ex['bits']}-bit deltas; "
    if ex["chunk"] is None:
        return head + "every round closes from all deltas (--no-slices)" + _outer_words(ex.get("outer"))
    last = {None: "", 0: "; the last round closed from all deltas"}.get(
        ex["last_slices"], f"; the last round from {ex['last_slices']} slices")
    least = ex.get("slice_min")
    where = "" if least is None else f" where that saves each peer {_size(least)} a round, else from all deltas"
    return (head + f"rounds of {ex['slices_from']} or more authors close from reduced slices (chunks of "
            f"{ex['chunk']:,} values, the mean at {ex['slice_bits']} bits){where}{last}"
            + _outer_words(ex.get("outer")))


def _outer_words(step: dict[str, Any] | None) -> str:
    """``; outer step lr 0.7, momentum 0.6953 (picked for 4 contributions)``."""
    if not step:
        return ""
    how = (f"picked for {step['contributions']} contribution{'s' * (step['contributions'] != 1)}" if step["picked"]
           else "the job's own, fixed at submit")
    lr = f"lr {step['lr']:g}" + (f" on a {step['schedule']} schedule" if step.get("schedule", "constant") != "constant"
                                else "")
    return f"; outer step {lr}, momentum {step['momentum']:g} ({how})"


def spot_check_line(checks: dict[str, int] | None) -> str | None:
    """What ``ttpeer status`` says of the spot checks this peer made (the status JSON's
    ``spot_checks``), or None before its first."""
    if not checks or not checks["reproduced"] + checks["missed"]:
        return None
    line = f"spot checks: {checks['reproduced']} of the others' reduced slices reproduced here on one chunk"
    if checks["missed"]:
        line += (f"; {checks['missed']} did not (this peer reduced each whole and published its own result; "
                 "a third peer settles it; the log names the slice and its author)")
    return line


def _find_job(jobs: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    found = [j for j in jobs if j["id"].startswith(prefix.lower())]
    if not found:
        raise JobError(f"no job {prefix!r} is known to this peer (see 'ttpeer status')")
    if len(found) > 1:
        raise UsageError(f"job prefix {prefix!r} is ambiguous; give more characters")
    return found[0]


WAIT_PARTIAL = 4
"""``ttpeer wait``'s exit status when the job is done but some peers failed it: the pool
trained it with fewer machines than it started with."""


def wait(args: argparse.Namespace, home: Any) -> int:
    """``ttpeer wait JOB [--json]``: 0 when done on every peer that started it;
    ``WAIT_PARTIAL`` (4) when done but peers failed it (each named with its reason);
    1 (JobError) if declined, failed or cancelled here, or skipped (it finished before this
    peer joined); 2 on timeout."""
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    delay = 0.2
    while True:
        job = _find_job(_status_obj(home)["jobs"], args.job)
        if job["state"] == "done":
            failed = [d for d in job.get("declines") or [] if d.get("code") == "failed"]
            if args.json:
                print(json.dumps({"job": job["id"], "state": "done", "rounds": job["rounds"],
                                  job["metric_name"]: job["eval_metric"], "eval_loss": job["eval_loss"],
                                  "failed_peers": [{k: d[k] for k in ("peer", "name", "reason")} for d in failed]}))
            else:
                where = "" if not failed else " without " + ", ".join(d["name"] for d in failed)
                print(f"job {job['id'][:12]} done{where}: {job['rounds']} rounds, {job['metric_name']} "
                      f"{job['eval_metric']}")
                for d in failed:
                    print(f"  failed on {d['name']} ({d['peer'][:12]}), which trained nothing more of it: "
                          f"{d['reason']}", file=sys.stderr)
            return WAIT_PARTIAL if failed else 0
        if job["state"] in ("declined", "failed", "cancelled", "skipped"):
            if args.json:
                print(json.dumps({"job": job["id"], "state": job["state"], "why": _why_ended(job)}))
            raise JobError(_why_ended(job))
        if deadline is not None and time.monotonic() >= deadline:
            print(f"error: timed out waiting for job {job['id'][:12]} (round {round_now(job)}/{job['rounds']})",
                  file=sys.stderr)
            return 2
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)


_SKIPPED = ("it was submitted before this machine joined and finished without it, so it holds no "
            "model of it: export it on a peer that trained it")


def _why_ended(job: dict[str, Any]) -> str:
    """One line: why ``job`` (a status entry) will not finish on this peer."""
    jid, end = job["id"][:12], job.get("ended")
    if job["state"] == "skipped":
        return f"job {jid}{_SKIPPED[2:]}"
    if job["state"] == "cancelled" and end:
        return f"job {jid} was cancelled by {end['by']['name']}"
    if job["state"] == "failed" and end:
        reasons = "; ".join(f"{r['name']}: {r['reason']}" for r in end["reasons"])
        return f"job {jid} failed on every peer: {reasons}"
    if job["state"] == "failed":
        return f"job {jid} failed on this peer (the others go on without it): {job['declined']}"
    return f"job {jid} was declined by this peer: {job['declined']}"
