"""``scripts/bench/memory``: peak resident memory of a fused job, per peer, per process.

A relay and 2 peers as processes on loopback train a fused job of a >= 50M-parameter
charlm on the CPU, once per shard count asked for. A thread samples every 0.1 s the
resident set (``/proc/PID/statm``) of each peer's daemon and of every process under
it (its task workers, the spare one), and keeps the peak of each process and of
their sum at one instant. Prints bytes/parameter per peer, the peak by process, what
the job was doing at the peak, and the fit check's estimate beside the measured
figure. Target: peak <= 36 bytes/parameter + 0.6 GB per peer, whatever the shard count.

``--abort-above GB`` stops a run whose peers together pass that much (the old code
grows with the shard count and could take the machine's memory from everyone else):
the figure is then a lower bound, and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ttpeer_harness import make_pool, status, temporary_cluster, ttpeer, wait_for

TASK = "charlm:n_layer=8,d_model=768,n_head=12,block_size=64"
PAGE = os.sysconf("SC_PAGE_SIZE")
ALLOWED_PER_PARAM, ALLOWED_FIXED = 36, 0.6e9


@dataclass
class PeerPeak:
    """Peak resident bytes of one peer's processes, sampled together."""

    root: int
    total: int = 0
    at: float = 0.0
    doing: str = ""
    by_pid: dict[int, int] = field(default_factory=dict)  # each process's own peak
    names: dict[int, str] = field(default_factory=dict)
    at_peak: dict[int, int] = field(default_factory=dict)  # each process at the moment of ``total``


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _name(pid: int, root: int) -> str:
    if pid == root:
        return "daemon"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "process"
    return "worker" if any(b"_worker" in a for a in argv) else b" ".join(argv[:3]).decode(errors="replace")


class Sampler(threading.Thread):
    def __init__(self, roots: list[int], abort_above: float, every: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.peaks = [PeerPeak(r) for r in roots]
        self.every, self.abort_above = every, abort_above
        self.doing = ["starting"] * len(roots)
        self.began = time.monotonic()
        self.halt = threading.Event()
        self.aborted = False

    def run(self) -> None:
        while not self.halt.wait(self.every):
            together = 0
            for i, peak in enumerate(self.peaks):
                now = {p: _rss(p) for p in _tree(peak.root)}
                total = sum(now.values())
                together += total
                for p, rss in now.items():
                    peak.names.setdefault(p, _name(p, peak.root))
                    peak.by_pid[p] = max(peak.by_pid.get(p, 0), rss)
                if total > peak.total:
                    peak.total, peak.at, peak.doing = total, time.monotonic() - self.began, self.doing[i]
                    peak.at_peak = dict(now)
            if together > self.abort_above:
                self.aborted = True
                return


def _estimate(task: str, batch: int, shards: int) -> int | None:
    """The fit check's estimate of the job's bytes on a CPU peer (an overlapped job, as
    ``submit`` makes a fused one), or None where this version's ``memory_need`` differs
    (the bench also runs against older commits)."""
    try:
        from ttpeer import train
        from ttpeer.daemon.worker._torch import KEEP_STATES

        loaded = train.load_task(task, Path.home() / ".cache", {})
        need = train.memory_need(loaded, batch_size=batch, shards=shards, held_states=KEEP_STATES, overlap=True)
        return int(getattr(need, "resident", need.total))
    except Exception:  # noqa: BLE001 - an estimate is a bonus here, never a failure
        return None


def run_one(args: argparse.Namespace, shards: int) -> dict[str, object]:
    with temporary_cluster() as cluster:
        url, fp = cluster.start_relay()
        homes = make_pool(cluster, url, fp, [f"peer{i}" for i in range(args.peers)])
        roots = [cluster.named[h.name].pid for h in homes]
        sampler = Sampler(roots, args.abort_above * 1e9)
        sampler.start()
        began = time.monotonic()
        job = ttpeer("submit", "--home", str(homes[0]), "--task", args.task, "--rounds", str(args.rounds),
                     "--inner-steps", str(args.inner_steps), "--shards", str(shards),
                     "--batch-size", str(args.batch_size))[-1]

        def done() -> bool:
            if sampler.aborted:
                return True
            try:
                jobs = [j for h in homes for j in status(h)["jobs"] if j["id"] == job]
            except OSError:  # a daemon busy in torch (the old in-process executor) answers late
                return False
            for i, j in enumerate(jobs):
                sampler.doing[i] = f"round {j['round']}, {j['state']}"
            return len(jobs) == len(homes) and all(j["state"] in ("done", "failed") for j in jobs)

        wait_for(done, args.timeout, f"the {shards}-shard job to finish", poll=1.0)
        wall = time.monotonic() - began
        sampler.halt.set()
        sampler.join()
        params = 0
        if not sampler.aborted:
            ttpeer("export", job, str(homes[0] / "model.safetensors"), "--home", str(homes[0]))
            params = json.loads((homes[0] / "model.json").read_text())["param_count"]
        states = [j["state"] for h in homes for j in status(h)["jobs"] if j["id"] == job]
    return {"shards": shards, "peaks": sampler.peaks, "wall": wall, "params": params,
            "aborted": sampler.aborted, "states": states}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default=TASK, help=f"a task of >= 50M parameters (default {TASK})")
    # A job shaped like real use: several shards a peer, several steps a round (overlapped).
    p.add_argument("--shards", default="8", help="shard counts, one job each (default 8)")
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--inner-steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--timeout", type=float, default=3600, help="seconds one job may take")
    p.add_argument("--abort-above", type=float, default=18.0,
                   help="GB of all peers together at which a run stops (default 18)")
    p.add_argument("--params", type=int, default=57_140_992,
                   help="parameter count to divide by when a run was stopped before its export")
    args = p.parse_args()

    results = [run_one(args, int(s)) for s in args.shards.split(",")]
    params = next((r["params"] for r in results if r["params"]), args.params)
    print(f"task {args.task}: {params} parameters; {args.peers} peers on loopback, CPU, {args.rounds} rounds x "
          f"{args.inner_steps} inner steps, batch {args.batch_size}")
    print("| shards | peer | peak RSS | bytes/param | target | daemon peak | worker peaks | at the peak "
          "| fit estimate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        estimate = _estimate(args.task, args.batch_size, int(r["shards"]))  # type: ignore[arg-type]
        for i, peak in enumerate(r["peaks"]):  # type: ignore[attr-defined]
            daemon = peak.by_pid.get(peak.root, 0)
            workers = sorted((v for pid, v in peak.by_pid.items() if pid != peak.root), reverse=True)
            limit = ALLOWED_PER_PARAM * params + ALLOWED_FIXED
            bound = ">= " if r["aborted"] else ""
            print(f"| {r['shards']} | {i} | {bound}{peak.total / 2**30:.2f} GiB | {bound}{peak.total / params:.1f} | "
                  f"{'ok' if peak.total <= limit else 'OVER'} (<= {limit / 2**30:.2f} GiB) | "
                  f"{daemon / 2**30:.2f} GiB | {', '.join(f'{w / 2**30:.2f}' for w in workers) or '-'} GiB | "
                  f"{peak.doing}, {peak.at:.0f} s in | "
                  f"{f'{estimate / 2**30:.2f} GiB ({estimate / peak.total:.2f}x)' if estimate else 'n/a'} |")
        print(f"<!-- {r['shards']} shards: {r['wall']:.0f} s, job states {r['states']}"
              f"{', STOPPED above --abort-above' if r['aborted'] else ''} -->")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
