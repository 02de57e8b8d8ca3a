"""``scripts/chaos --load``: a busy pool on one relay, with the relay's footprint sampled.

Eight peers on one relay (real processes, as in the campaign); the admin adds a
generated dataset of records (``bench.data``'s generator and task), then submits three
jobs at once: a fused mnist1d job, a fused job on the dataset (so every peer fetches its
pieces while the others train) and a 3-member mnist1d ensemble. Every job must finish on
every peer with identical exports, the campaign's invariant, exit and log checkers hold,
and the relay's RSS and open files are sampled every second from /proc: printed at
start, at their peak and at the end, with bounds (``RSS_BOUND``, ``FDS_BOUND``) whose
breach is a violation.
"""

from __future__ import annotations

import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ttpeer.errors import TtpeerError
from ttpeer_harness import READY_TIMEOUT, status, ttpeer, wait_for

from . import data as data_bench
from ._chaos_check import invariants, logs
from ._chaos_plan import Plan
from ._chaos_proxy import Proxies
from ._chaos_run import Pool, Result
from ._chaos_run import job_status as _job
from ._chaos_run import state as _state

PEERS = 8
DATA_SIZE = 16 << 20  # 4,096 records of 4 KiB
PIECE = 1 << 20
RSS_BOUND = 512 << 20  # bytes: the relay's resident memory may not pass this
FDS_BOUND = 256  # the relay's open files (sockets included)
LOAD_BOUND = 900.0  # seconds for all three jobs to finish everywhere


@dataclass
class Footprint:
    """The relay's RSS (bytes) and open files, sampled."""

    rss: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)

    def sample(self, pid: int) -> None:
        try:
            with open(f"/proc/{pid}/status") as f:
                rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
        except (OSError, StopIteration):
            return
        self.rss.append(rss)
        self.fds.append(fds)

    def lines(self) -> list[str]:
        if not self.rss:
            return ["relay footprint: not sampled"]
        mib = [r / (1 << 20) for r in self.rss]
        return [f"relay RSS: {mib[0]:.0f} MiB at start, {max(mib):.0f} MiB at peak, {mib[-1]:.0f} MiB at the end "
                f"(bound {RSS_BOUND >> 20} MiB; {len(mib)} samples)",
                f"relay open files: {self.fds[0]} at start, {max(self.fds)} at peak, {self.fds[-1]} at the end "
                f"(bound {FDS_BOUND})"]

    def violations(self) -> list[str]:
        out = []
        if self.rss and max(self.rss) > RSS_BOUND:
            out.append(f"load: the relay's RSS reached {max(self.rss) >> 20} MiB (bound {RSS_BOUND >> 20})")
        if self.fds and max(self.fds) > FDS_BOUND:
            out.append(f"load: the relay held {max(self.fds)} open files (bound {FDS_BOUND})")
        return out


def _sampler(pid: int, fp: Footprint, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        fp.sample(pid)


def load_run(root: Path, proxies: Proxies) -> tuple[list[str], list[str]]:
    """Run the load; the report's lines and the violations."""
    pool = Pool(root, proxies)
    names = [f"peer{i}" for i in range(PEERS)]
    plan = Plan(seed=-1, peers=PEERS, mode="load", rounds=0, inner_steps=0)
    res = Result(plan, root, homes={n: root / n for n in names}, survivors=names)
    report: list[str] = []
    violations: list[str] = []
    fp = Footprint()
    stop = threading.Event()
    started = time.monotonic()
    try:
        url, pin = pool.start_relay("relay0")
        sampler = threading.Thread(target=_sampler, args=(pool.procs["relay0"].pid, fp, stop), daemon=True)
        fp.sample(pool.procs["relay0"].pid)
        sampler.start()
        admin = res.homes[names[0]]
        ttpeer("pool", "create", "--relay", url, "--fingerprint", pin, "--name", names[0], "--home", str(admin))
        pool.up(names[0], admin)
        wait_for(lambda: status(admin)["node"]["has_pool_key"], READY_TIMEOUT, "the admin to start")
        token = ttpeer("invite", "--uses", str(PEERS - 1), "--home", str(admin))[-1]
        res.tokens.append(token)
        for name in names[1:]:
            pool.join(name, res.homes[name], token)
        wait_for(lambda: all(len(status(h)["peers"]) == PEERS and status(h)["node"]["has_pool_key"]
                             for h in res.homes.values()), 3 * READY_TIMEOUT, f"{PEERS} peers", poll=0.5)
        samples = data_bench.generate(root / "synth.bin", DATA_SIZE, seed=0)
        ttpeer("data", "add", str(root / "synth.bin"), "--name", "synth", "--piece-size", str(PIECE),
               "--format", f"records:{data_bench.RECORD}", "--home", str(admin))
        task = root / "synth_task.py"
        task.write_text(textwrap.dedent(data_bench.TASK.format(features=data_bench.FEATURES, test=256, batch=32)))
        common = ("--lease", "10s", "--home", str(admin))
        jobs = {
            "fused mnist1d": ttpeer("submit", "--task", "mnist1d", "--rounds", "4", "--shards", str(PEERS),
                                    "--inner-steps", "40", "--batch-size", "32", *common)[-1],
            "fused on the dataset": ttpeer("submit", "--task", str(task), "--rounds", "3", "--shards", str(PEERS),
                                           "--inner-steps", "15", *common)[-1],
            "ensemble mnist1d": ttpeer("submit", "--task", "mnist1d", "--mode", "ensemble", "--members", "3",
                                       "--rounds", "3", "--inner-steps", "60", "--batch-size", "32", *common)[-1],
        }
        submitted = time.monotonic()
        report.append(f"{PEERS} peers on one relay; dataset {DATA_SIZE >> 20} MiB ({samples} records, pieces of "
                      f"{PIECE >> 20} MiB) added by {names[0]}; three jobs submitted together")

        def all_done() -> bool:
            return all((j := _job(h, job)) is not None and j["state"] in ("done", "failed", "cancelled")
                       for h in res.homes.values() for job in jobs.values())

        try:
            wait_for(all_done, LOAD_BOUND, "the three jobs to end on every peer", poll=1.0)
        except TtpeerError as exc:
            violations.append(f"load: {exc}")
        report.append(f"jobs ended {time.monotonic() - submitted:.0f} s after submit")
        for what, job in jobs.items():
            res.job = job
            states = {_state(h, job) for h in res.homes.values()}
            found = [f"load: {what}: {v}" for v in invariants(res)]
            if states != {"done"}:
                found.append(f"load: {what} is {sorted(map(str, states))} across the peers, not done everywhere")
            violations += found
            report.append(f"{what} ({job[:12]}): {'done on every peer, identical exports' if not found else 'FAILED'}")
    except (TtpeerError, OSError) as exc:
        violations.append(f"load: {type(exc).__name__}: {exc}")
    finally:
        stop.set()
        unexpected = [f"load: {n} exited with {p.returncode}" for n, p in pool.procs.items() if p.poll() is not None]
        pool.close()
    violations += unexpected + [f"load: {v}" for v in logs(res)] + fp.violations()
    report += fp.lines() + [f"whole run {time.monotonic() - started:.0f} s"]
    return report, violations

