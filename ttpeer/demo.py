"""``ttpeer demo``: a relay and three peers, each a real process on loopback.

It creates a pool in a temporary directory, starts the relay and the peers the
way a user would (``ttpeer relay``, ``ttpeer up``, ``ttpeer join TOKEN``),
trains mnist1d in fused mode, then an ensemble of 3 members with the same data
budget, then the fused job on a pool of one peer, and prints them side by side.
Every process it starts is stopped before it returns, also when interrupted.

The demo runs ttpeer's commands through ``command`` (``ttpeer.cli.run``, handed down by
``ttpeer demo``, so this module does not import the CLI back). The test and bench
harness beside the package (``ttpeer_harness``, not installed) drives its processes
with the same ``Cluster``, ``make_pool`` and ``wait_for``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ttpeer.errors import TtpeerError

READY_TIMEOUT = 60.0
PEER_THREADS = 1  # torch's threads in each process started (OMP_NUM_THREADS): they share the cores

Command = Callable[..., list[str]]
"""Runs one ttpeer command (``command("export", JOB, OUT, "--home", HOME)``) and returns
its output lines; raises ``TtpeerError`` if it fails (``ttpeer.cli.run``)."""


@dataclass
class Outcome:
    label: str
    accuracy: float
    wall_s: float
    bytes_wire: int
    ratio: float | None
    hashes: list[str]
    best_member: float | None = None  # ensemble jobs: the best single member's test metric


class Cluster:
    """Processes started for the demo or a test; ``close`` stops every one of them."""

    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        self.named: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {**os.environ, "OMP_NUM_THREADS": str(PEER_THREADS), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env.pop("TTPEER_HOME", None)
        # The processes must not pick up the user's own settings (a fixed metrics port...).
        self.env["TTPEER_CONFIG"] = str(root / "ttpeer.toml")

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        out = open(self.root / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "ttpeer", *args], stdout=out, stderr=subprocess.STDOUT,
                                env=self.env, start_new_session=True)
        out.close()
        self.procs.append(proc)
        self.named[name] = proc
        return proc

    def start_relay(self, name: str = "relay") -> tuple[str, str]:
        """Start a relay (its process, log and data folder named ``name``); its URL and pin."""
        proc = self.spawn(name, "relay", "--listen", "127.0.0.1:0", "--data", str(self.root / name))
        deadline = time.monotonic() + READY_TIMEOUT
        log = self.root / f"{name}.log"
        while time.monotonic() < deadline:
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("relay ready "):
                    _, _, url, fp = line.split()
                    return url, fp
            if proc.poll() is not None:
                raise TtpeerError(f"the relay exited early:\n{log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        raise TtpeerError("the relay did not report ready in time")

    def close(self) -> None:
        stop_processes(self.procs)


def stop_processes(procs: list[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
    """SIGTERM every process group still running, then SIGKILL those that have not
    exited ``grace`` seconds later; returns when all of them have exited."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def status(home: Path) -> dict[str, Any]:
    from ttpeer.daemon import call

    return call(home / "control.sock", {"op": "status"}, timeout=10)["status"]


def wait_for(condition, timeout: float, what: str, poll: float = 0.1):  # type: ignore[no-untyped-def]
    """Poll ``condition`` until it returns something truthy; raise after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except TtpeerError as exc:
            last_exc = exc
        time.sleep(poll)
    raise TtpeerError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" ({last_exc})" if last_exc else ""))


def make_pool(cluster: Cluster, url: str, fp: str, names: list[str], extra: tuple[str, ...] = (), *,
              command: Command) -> list[Path]:
    """Create a pool whose admin is ``names[0]`` and start every peer as a process
    (``extra``: more arguments for ``ttpeer up`` and ``ttpeer join``)."""
    homes = [cluster.root / name for name in names]
    lines = command("pool", "create", "--relay", url, "--fingerprint", fp, "--name", names[0],
                   "--uses", str(max(1, len(names) - 1)), "--home", str(homes[0]))
    token = lines[-1]
    cluster.spawn(names[0], "up", "--home", str(homes[0]), *extra)
    for name, home in zip(names[1:], homes[1:], strict=True):
        cluster.spawn(name, "join", token, "--name", name, "--home", str(home), *extra)

    def all_in() -> bool:
        for home in homes:
            st = status(home)
            if not st["node"]["has_pool_key"] or len(st["peers"]) < len(homes):
                return False
        return True

    wait_for(all_in, READY_TIMEOUT, f"{len(homes)} peers to enroll")
    return homes


def job_spec(rounds: int) -> dict[str, Any]:
    """The demo's fused job: fixed rounds that wait (a short run's rounds are few), with the
    outer step each close picks (``outer_auto``), as ``ttpeer submit`` gives."""
    return {"task": "mnist1d", "mode": "fused", "rounds": rounds, "shards": 6, "batches": 60, "batch_size": 64,
            "inner_lr": 2e-3, "weight_decay": 0.01, "outer_lr": 0.7, "outer_momentum": 0.7, "outer_auto": 1,
            "bits": 8, "seed": 0, "lease": 10.0, "steal": True}


def ensemble_spec(rounds: int, members: int = 3) -> dict[str, Any]:
    """An ensemble with the fused demo job's data budget: members x rounds x 120 steps
    = rounds x 6 shards x 60 steps when members = 3."""
    fused = {k: v for k, v in job_spec(rounds).items() if k != "outer_auto"}  # members have no outer step
    return {**fused, "mode": "ensemble", "members": members, "shards": None,
            "batches": 360 // members}


def run_job(homes: list[Path], spec: dict[str, Any], label: str, command: Command, progress: Any = None) -> Outcome:
    from ttpeer.daemon import call

    sent_before = sum(status(h)["bytes_sent"] for h in homes)  # counters are per daemon, not per job
    started = time.monotonic()
    job = call(homes[0] / "control.sock", {"op": "submit", "spec": spec, "task_file": None}, timeout=120)["job"]
    task = progress.add_task(label, total=spec["rounds"]) if progress else None

    def done() -> bool:
        states = []
        for home in homes:
            jobs = [j for j in status(home)["jobs"] if j["id"] == job]
            states.append(jobs[0] if jobs else None)
        if progress and states[0]:
            progress.update(task, completed=states[0]["round"])
        # "done" once each peer has written its final model (status says "finishing" before)
        return all(s is not None and s["state"] == "done" for s in states)

    wait_for(done, 600, f"job {job[:12]} to finish on every peer", poll=0.25)
    wall = time.monotonic() - started
    finals = [status(h) for h in homes]
    hashes = [command("export", job, str(h / "model.safetensors"), "--home", str(h))[-1] for h in homes]
    first = [j for j in finals[0]["jobs"] if j["id"] == job][0]
    ratios = [j["compression_ratio"] for st in finals for j in st["jobs"] if j["id"] == job and j["compression_ratio"]]
    best = None
    if spec["mode"] == "ensemble":
        side = json.loads((homes[0] / "model.json").read_text())
        best = max(m[side["metric_name"]] for m in side["members"])
    return Outcome(label, first["eval_metric"], wall, sum(st["bytes_sent"] for st in finals) - sent_before,
                   sum(ratios) / len(ratios) if ratios else None, hashes, best)


@contextlib.contextmanager
def temporary_cluster(keep: bool = False) -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="ttpeer-demo-"))
    cluster = Cluster(root)
    try:
        yield cluster
    finally:
        cluster.close()
        if keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def run_demo(command: Command, rounds: int = 8, keep: bool = False) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console()
    with temporary_cluster(keep) as cluster:
        console.print("[bold]ttpeer demo[/]: a relay and 3 peers as separate processes on 127.0.0.1")
        url, fp = cluster.start_relay()
        console.print(f"relay ready at {url} ({fp[:23]}...)")
        pool = make_pool(cluster, url, fp, ["alice", "bob", "carol"], command=command)
        console.print("3 peers enrolled; training mnist1d, fused mode")
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("rounds"),
                   TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            fused = run_job(pool, job_spec(rounds), "fused pool (3 peers)", command, progress)
            ensemble = run_job(pool, ensemble_spec(rounds), "ensemble pool (3 peers, 3 members)", command, progress)
            solo_pool = make_pool(cluster, url, fp, ["solo"], command=command)
            solo = run_job(solo_pool, job_spec(rounds), "one peer alone", command, progress)
        advice = _advice(pool[0])  # while the relay runs: its loopback link is measured
    identical = len(set(fused.hashes)) == 1 and len(set(ensemble.hashes)) == 1
    table = Table(title=f"mnist1d, same data budget: {rounds} rounds x 6 shards x 60 steps "
                        f"(ensemble: 3 members x {rounds} units x 120 steps)")
    for col in ("run", "test accuracy", "best member", "wall time", "bytes on the wire", "compression vs fp32"):
        table.add_column(col, justify="right" if col != "run" else "left")
    for o in (solo, fused, ensemble):
        table.add_row(o.label, f"{o.accuracy:.3f}", "-" if o.best_member is None else f"{o.best_member:.3f}",
                      f"{o.wall_s:.1f} s", _human(o.bytes_wire), f"{o.ratio:.1f}x" if o.ratio else "-")
    console.print(table)
    console.print(f"exported model sha256 on the 3 peers: fused {fused.hashes[0][:16]}..., ensemble bundle "
                  f"{ensemble.hashes[0][:16]}... ({'bit-identical' if identical else 'DIFFERENT'} on every peer)")
    for line in advice:
        console.print(line, highlight=False)
    return 0 if identical else 1


def _advice(home: Path) -> list[str]:
    """Why the table looks as it does: ``ttpeer advise --quick`` for the fused job on 3
    separate machines like this one (here the 3 peers share one machine's cores)."""
    from ttpeer._advise_cmd import quick_advice

    spec = job_spec(1)
    try:
        figures, said = quick_advice(spec["task"], home, peers=3, batch=spec["batch_size"], bits=spec["bits"],
                                     overlap=False, chunk=spec.get("chunk"), threads=PEER_THREADS)
    except TtpeerError as exc:
        return [f"(ttpeer advise could not run here: {exc})"]
    return [f"why: 'ttpeer advise --quick' for this job on 3 separate machines like this one: {said}",
            f"  ({figures}; here the 3 peers share one machine's cores)"]


def _human(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"
