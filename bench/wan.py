"""The WAN benchmark behind ``scripts/bench/wan`` (issue 7, part 3).

Two peers on a shaped link of the network lab (``ttpeer_harness/netlab.py``): each
peer's access link is ``--rate`` each way (tbf) with ``--delay`` added to each
direction of its TCP connections. One model and data set for all rows: the ttpeer task
``--task`` (default the mnist1d MLP on 60,000 generated signals), batch 64, AdamW lr 2e-3
weight decay 0.01, gradients clipped to 1.0; DiLoCo rows average every H inner steps with
Nesterov SGD lr 0.7 and momentum ``--outer-momentum`` (0.5 by default, for every DiLoCo row).

Rows, one after the other in one lab:

- ``one peer alone``: a plain loop with no network (``wan_worker.py single``);
- ``gloo DDP``: all-reduce of gradients every step, 2 processes;
- ``DDP, same math on loopback``: the same DDP run to ttpeer's sample count with both
  processes on one host (no shaped link, no slowdown), only for the loss at equal samples:
  synchronous DDP computes the same model whatever the link, and on the shaped link it
  would take many minutes to train that many samples;
- ``torchft DiLoCo``: torchft 0.2.0's ``DiLoCo`` with the same H, a lighthouse on peer 0;
- ``ttpeer fused``: a relay and 2 ttpeer peers behind NAT routers, one job with 2 shards
  of H batches per round (each peer trains one shard a round).

The synchronous baselines need peers that reach each other: they run on ``routed``
lab hosts (plain routers, still shaped). ttpeer's peers sit behind NAT and talk only
through the relay, so each byte between them crosses two shaped links and two delays
(the baselines' direct connections cross one delay): the comparison is tilted towards
the baselines, not against them.

Measured per row: wall time until the eval loss first reaches ``--target`` (from the
moment every peer is connected; ttpeer: from the job's submission), bytes sent per peer
(``tx_bytes`` of each peer's ``eth0`` from ``/proc/net/dev`` in its namespace: the same
count for every system, headers, heartbeats and retransmissions included), bytes per
training sample, utilization (a peer's seconds in inner steps / wall, mean over peers;
ttpeer's own ``status`` reports it) and the eval loss at ttpeer's sample count (linear
between a row's evaluations around it; n/a for a row that trained fewer). Writes a markdown
table to stdout and ``--markdown``, and a PNG of eval loss against wall time.

torchft is installed into the running venv if missing (not a ttpeer dependency).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ttpeer_harness.netlab import Host, Lab, start_pool, start_relay, unavailable

from ._wan_report import BATCH, PEERS, Row, plot, table


def _tx_bytes(host: Host) -> int:
    for line in host.run(["cat", "/proc/net/dev"]).stdout.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == host.near:
            return int(rest.split()[8])
    raise RuntimeError(f"no {host.near} in /proc/net/dev of {host.name}")


def _worker(mode: str, *args: str) -> list[str]:
    # By path: a lab host's process needs only ttpeer installed, not this folder on its path.
    return [sys.executable, str(Path(__file__).with_name("wan_worker.py")), mode, *args]


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float, what: str, lab: Lab, logs: list[str]) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{what} did not finish in {timeout:.0f} s:\n"
                               + "\n".join(lab.log(n)[-1500:] for n in logs)) from None
        if code != 0:
            raise RuntimeError(f"{what} failed ({code}):\n" + "\n".join(lab.log(n)[-3000:] for n in logs))


def _read_curve(row: Row, path: Path) -> Row:
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "end" in rec:
            row.wall, row.samples = rec["end"], rec["samples"]
        else:
            row.curve.append((rec["t"], rec["samples"], rec["loss"]))
    return row


def _baseline(lab: Lab, name: str, mode: str, hosts: list[Host], common: list[str], seconds: float,
              extra: list[list[str]], tag: str = "", ifname: str = "eth0") -> Row:
    tag = tag or mode
    out = lab.dir / f"{tag}.jsonl"
    before = [_tx_bytes(h) for h in hosts]
    procs = [h.popen(_worker(mode, "--rank", str(i), "--world", str(len(hosts)), "--host", h.addr,
                             "--out", str(out), *common, *extra[i]), f"{tag}-{i}",
                     env={"GLOO_SOCKET_IFNAME": ifname})
             for i, h in enumerate(hosts)]
    _wait_all(procs, seconds + 240, name, lab, [f"{tag}-{i}" for i in range(len(hosts))])
    row = _read_curve(Row(name), out)
    row.sent = [_tx_bytes(h) - b for h, b in zip(hosts, before, strict=True)]
    busy = [json.loads(line)["busy"] for line in out.read_text().splitlines() if '"end"' in line]
    row.utilization = busy[0] / row.wall if row.wall else None  # rank 0's (only rank 0 writes)
    return row


def start_peers(lab: Lab, relay: tuple[str, str], names: list[str], emulation: tuple[str, ...]) -> dict[str, Path]:
    """ttpeer on the lab hosts ``names`` (daemons given ``emulation``: ``--slowdown S``, ``--step-s T``),
    enrolled in one pool on ``relay`` (its URL and fingerprint, ``start_relay``) with the first as admin;
    the lab's data copied into their homes (the baselines found it generated too: no row pays for it)."""
    url, fp = relay
    homes = start_pool(lab, url, fp, names[0], names[1:], extra=emulation)
    for home in homes.values():
        (home / "data").mkdir(exist_ok=True)
        for cached in (lab.dir / "data").iterdir():
            shutil.copy(cached, home / "data" / cached.name)
    return homes


def _pool(lab: Lab, args: argparse.Namespace) -> dict[str, Path]:
    """A relay and ttpeer on alice and bob (NAT), enrolled; the data in their homes."""
    return start_peers(lab, start_relay(lab), ["alice", "bob"], ("--slowdown", str(args.slowdown)))


def _ttpeer(lab: Lab, homes: dict[str, Path], args: argparse.Namespace, rounds: int, overlap: bool) -> Row:
    from ttpeer_harness import job_spec

    spec = {**job_spec(rounds), "task": args.task, "bits": args.bits, "shards": PEERS, "batches": args.H,
            "lease": 60.0}
    if overlap:
        spec["overlap"] = 1  # round r+1 trains while round r's deltas cross the link
    name = "ttpeer fused, overlapped" if overlap else "ttpeer fused"
    if args.auto:  # the same budget (rounds x H), in rounds the pool sizes (--inner-steps auto)
        spec["h_min"], spec["h_max"] = args.auto
        spec["batches"] = min(max(25, args.auto[0]), args.auto[1])
        spec["rounds"] = rounds * args.H // spec["batches"]
        name += f", auto H {args.auto[0]}-{args.auto[1]}"
    spec["outer_momentum"] = args.outer_momentum
    return ttpeer_row(lab, homes, spec, name, args.seconds + 300)


def ttpeer_row(lab: Lab, homes: dict[str, Path], spec: dict[str, Any], name: str, timeout: float) -> Row:
    """Submit the fused job ``spec`` on the first of ``homes`` and follow it on every peer
    until each has it done: the submitter's eval loss after each closed round (samples from
    the round sizes it reports, so an auto-cadence job's too), bytes, utilization (each
    peer's seconds in inner steps / seconds from the submission to its done, averaged)."""
    from ttpeer.daemon import call
    from ttpeer_harness import status

    first = next(iter(homes))
    hosts = [lab.hosts[n] for n in homes]
    per_step, first_size, budget = spec["shards"] * spec["batch_size"], spec["batches"], _budget(spec)
    before = [_tx_bytes(h) for h in hosts]
    t0 = time.monotonic()
    job = call(homes[first] / "control.sock", {"op": "submit", "spec": spec, "task_file": None},
               timeout=120)["job"]
    row = Row(name)
    seen, sizes, done_at, util, split = 0, {}, {}, {}, {}
    started: float | None = None
    finishing: set[str] = set()
    for tick in itertools.count():
        if len(done_at) == len(homes):
            break
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the ttpeer job did not finish in time:\n{lab.log(first)[-2000:]}")
        for peer, home in homes.items():
            # The submitter every tick (the curve); the others every 5th until they finish: a
            # status is work for a daemon, and 4 peers share the cores.
            if peer in done_at or (peer != first and peer not in finishing and tick % 5):
                continue
            entry = next((j for j in status(home)["jobs"] if j["id"] == job), None)
            if entry is None:
                continue
            if entry["state"] == "finishing" or entry["round"] + 1 >= entry["rounds"]:
                finishing.add(peer)
            if peer == first:
                if started is None and (entry["round"] > 0 or entry.get("training_shard") is not None):
                    started = time.monotonic() - t0
                if entry["round"] > seen:
                    seen = entry["round"]
                    done = sum(round_sizes(sizes, seen, first_size, budget))
                    row.curve.append((time.monotonic() - t0, per_step * done, entry["eval_loss"]))
                if entry["state"] == "running":
                    sizes.setdefault(entry["round"], int(entry["inner_steps"]))
            if entry["state"] == "done":
                done_at[peer] = time.monotonic() - t0
                secs = entry.get("seconds") or {}
                util[peer] = secs["train"] / done_at[peer] if secs.get("train") is not None else None
                work = {p["name"]: p for p in entry.get("peers") or []}.get(peer, {})
                split[peer] = {**secs, "shards": float(work.get("shards") or 0),
                               "samples/s": float(work.get("samples_per_s") or 0)}
        time.sleep(0.1)
    row.sent = [_tx_bytes(h) - b for h, b in zip(hosts, before, strict=True)]
    row.wall, row.samples = max(done_at.values()), per_step * budget
    row.rounds = round_sizes(sizes, seen, first_size, budget)
    known = [u for u in util.values() if u is not None]
    row.utilization = sum(known) / len(known) if known else None
    rates = [s["samples/s"] for s in split.values() if s["samples/s"]]
    row.step_s = spec["batch_size"] / (sum(rates) / len(rates)) if rates else None
    row.note = (f"the submitter trained its first shard {started:.1f} s after the submission; "
                if started is not None else "") + "seconds per peer (ttpeer status): " + "; ".join(
        f"{n} " + ", ".join(f"{k} {v:.1f}" for k, v in secs.items()) for n, secs in split.items())
    return row


def _budget(spec: dict[str, Any]) -> int:
    return int(spec["rounds"]) * int(spec["batches"])  # an auto-cadence job's too (Plan)


def round_sizes(seen: dict[int, int], rounds: int, first: int, budget: int) -> list[int]:
    """Inner steps per shard of each of the first ``rounds`` rounds, from the sizes ``seen``
    (by round) in status: a round not seen keeps the size before it, as ``Plan`` does, and
    the rounds never add up past the job's budget."""
    out, size, left = [], first, budget
    for r in range(rounds):
        size = seen.get(r, size)
        out.append(max(0, min(size, left)))
        left -= out[-1]
    return out


def _ensure(module: str, requirement: str) -> str | None:
    """Install ``requirement`` into this venv if ``module`` is missing; the reason if it can't be."""
    if importlib.util.find_spec(module) is not None:
        return None
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", requirement], capture_output=True, text=True)
    if done.returncode != 0:
        return f"pip install {requirement} failed: {done.stderr.strip()[-200:]}"
    importlib.invalidate_caches()
    return None


def _optional(name: str, module: str, requirement: str, run: Callable[[], Row]) -> Row:
    """A baseline row from a package ttpeer does not depend on: installed if missing; a row
    that says why if it cannot be installed or does not run."""
    why = _ensure(module, requirement)
    if why:
        return Row(name, note=f"did not run: {why}")
    try:
        return run()
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return Row(name, note=f"did not run: {str(exc).splitlines()[0][:120]}")


def _lighthouse(lab: Lab, host: Host, port: int) -> None:
    exe = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    if exe is None:
        raise RuntimeError("torchft_lighthouse is not in the venv's bin")
    host.popen([exe, "--min_replicas", str(PEERS), "--quorum_tick_ms", "50", "--join_timeout_ms", "2000",
                "--bind", f"0.0.0.0:{port}"], "lighthouse")
    lab.wait_port(host.ns, "0.0.0.0", port, "the torchft lighthouse")


def run(args: argparse.Namespace) -> list[Row]:
    from ttpeer.train import load_task

    rows: list[Row] = []
    with Lab(nat=["alice", "bob"], routed=["p0", "p1"], keep=args.keep) as lab:
        for name in ("alice", "bob", "p0", "p1"):
            lab.shape(name, args.rate, args.delay)
        data = lab.dir / "data"
        data.mkdir()
        load_task(args.task, data)  # generated once: the workers and the peers find the cache
        p0, p1 = lab.hosts["p0"], lab.hosts["p1"]
        common = ["--data", str(data), "--task", args.task, "--H", str(args.H), "--target", str(args.target),
                  "--slowdown", str(args.slowdown), "--outer-momentum", str(args.outer_momentum)]
        print(f"lab in {lab.dir}", file=sys.stderr)
        if "single" in args.rows:
            print("one peer alone...", file=sys.stderr)
            rows.append(_baseline(lab, "one peer alone", "single", [p0], [*common, "--seconds", str(args.seconds),
                                                                       "--eval-every", "25"], args.seconds, [[]]))
        master = [f"--master={p0.addr}:29500"]
        if "ddp" in args.rows:
            print("gloo DDP...", file=sys.stderr)
            rows.append(_baseline(lab, "gloo DDP (all-reduce every step)", "ddp", [p0, p1],
                              [*common, "--seconds", str(args.ddp_seconds), "--eval-every", "10"],
                              args.ddp_seconds, [master, master]))
        if "ddp-ref" in args.rows:
            print("DDP on loopback, for the loss at equal samples...", file=sys.stderr)
            local = ["--master=127.0.0.1:29501"]
            ref = [*common, "--slowdown", "0", "--steps", str(args.rounds * args.H), "--eval-every",
                   str(max(1, args.H // 5))]
            row = _baseline(lab, "DDP, same math on loopback (loss at equal samples only)", "ddp", [p0, p0],
                            ref, args.ddp_seconds, [local, local], tag="ddp-ref", ifname="lo")
            row.reference, row.sent, row.utilization = True, [], None  # its time and bytes mean nothing here
            rows.append(row)
        rounds = [*common, "--rounds", str(args.rounds)]
        if "diloco" in args.rows:
            print("torchft DiLoCo...", file=sys.stderr)

            def torchft() -> Row:
                _lighthouse(lab, p0, 29510)
                lh = [f"--lighthouse={p0.addr}:29510"]
                return _baseline(lab, f"torchft DiLoCo (H={args.H})", "diloco", [p0, p1], rounds,
                                 args.seconds * 3, [lh, lh])

            rows.append(_optional("torchft DiLoCo", "torchft", "torchft==0.2.0", torchft))
        if "hivemind" in args.rows:
            print("hivemind...", file=sys.stderr)
            rows.append(_optional("hivemind DiLoCo", "hivemind", "hivemind==1.1.12", lambda: _baseline(
                lab, f"hivemind DiLoCo (H={args.H})", "hivemind", [p0, p1], rounds, args.seconds * 3, [[], []])))
        homes = _pool(lab, args) if args.rows & {"ttpeer", "ttpeer-overlap"} else {}
        if "ttpeer" in args.rows:
            print("ttpeer fused...", file=sys.stderr)
            rows.append(_ttpeer(lab, homes, args, args.rounds, overlap=False))
        if "ttpeer-overlap" in args.rows:
            print("ttpeer fused, overlapped...", file=sys.stderr)
            rows.append(_ttpeer(lab, homes, args, args.rounds, overlap=True))
    return rows


def _bounds(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    if not (lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
        raise argparse.ArgumentTypeError(f"not bounds: {text!r} (use e.g. 10-1000)")
    return int(lo), int(hi)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench/wan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs: 6 rounds, DDP for 60 s (about 5 minutes)")
    ap.add_argument("--rate", default="20mbit")
    ap.add_argument("--delay", type=float, default=0.05, help="seconds added to each direction")
    ap.add_argument("--task", default="mnist1d:samples=60000", help="the ttpeer task every row trains")
    ap.add_argument("--H", type=int, default=250, help="inner steps per round (ttpeer, torchft DiLoCo)")
    ap.add_argument("--rounds", type=int, default=0, help="DiLoCo rounds (ttpeer, torchft, hivemind; default 20)")
    ap.add_argument("--bits", type=int, choices=(4, 8), default=4, help="ttpeer: bits per delta value")
    ap.add_argument("--target", type=float, default=0.6, help="target eval loss")
    ap.add_argument("--slowdown", type=float, default=3.0,
                    help="emulated compute: each step lasts (1 + S) x its real time (sleeping), in every row")
    ap.add_argument("--seconds", type=float, default=0, help="time budget of one peer alone (default 30 s)")
    ap.add_argument("--ddp-seconds", type=float, default=0,
                    help="time budget of DDP on the shaped link (default 420 s: long enough to reach the target)")
    ap.add_argument("--outer-momentum", type=float, default=0.5,
                    help="outer Nesterov momentum of every DiLoCo row (ttpeer, torchft, hivemind); default 0.5: "
                         "DiLoCo's 0.9 plateaued on this task in all three (see docs/benchmarks.md)")
    ap.add_argument("--auto", type=_bounds, default=None, metavar="MIN-MAX",
                    help="ttpeer rows: --inner-steps auto within MIN-MAX, on the same budget of --rounds x --H "
                         "inner steps per shard (first rounds 25)")
    ap.add_argument("--rows", default="single,ddp,ddp-ref,diloco,hivemind,ttpeer,ttpeer-overlap",
                    help="which rows to run (comma-separated)")
    ap.add_argument("--png", type=Path, default=Path("docs/bench-wan.png"))
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    ap.add_argument("--json", type=Path, default=None, help="also write every row's curve and counts here")
    ap.add_argument("--keep", action="store_true", help="keep the lab's directory (logs)")
    args = ap.parse_args(argv)
    args.rows = set(args.rows.split(","))
    args.seconds = args.seconds or (20.0 if args.quick else 30.0)
    args.ddp_seconds = args.ddp_seconds or (60.0 if args.quick else 420.0)
    args.rounds = args.rounds or (6 if args.quick else 20)
    why = unavailable()
    if why:
        print(f"scripts/bench/wan needs the network lab: {why}", file=sys.stderr)
        return 2
    load = os.getloadavg()
    rows = run(args)
    text, equal = table(rows, args.target)
    head = (f"2 peers, each link {args.rate} each way + {args.delay * 1000:.0f} ms each direction; task {args.task}, "
            f"batch {BATCH}, H={args.H}, {args.rounds} rounds, outer momentum {args.outer_momentum:g}, "
            f"ttpeer {args.bits}-bit deltas"
            f", steps slowed {1 + args.slowdown:g}x; "
            f"load average at start "
            f"{load[0]:.2f}, at end {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    notes = "\n".join(f"- {r.name}: {r.note}" for r in rows if r.curve and r.note)
    text = f"{text}\n\n{notes}" if notes else text
    print(f"\n{head}\n\n{text}\n")
    args.png.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, args.target, args.png, head)
    print(f"plot: {args.png}")
    if args.json:
        args.json.write_text(json.dumps({"head": head, "rows": [r.__dict__ for r in rows]}, indent=1))
    if args.markdown:
        args.markdown.write_text(f"{head}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
