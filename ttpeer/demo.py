"""``ttpeer demo``: a relay and four peers, each a real process on loopback.

It creates two pools in a temporary directory (three peers, and one peer alone), starting
the relay and the peers the way a user would (``ttpeer relay``, ``ttpeer pool create``,
``ttpeer up``, ``ttpeer join TOKEN``), and trains mnist1d three ways with the same steps a
peer: an ensemble of 3 members (a member a peer), the pool of one (``one peer alone``) and
the fused pool of 3. Every inner step is paced to ``STEP_S`` (``ttpeer up --step-s``: the
step sleeps what its computation leaves), standing for a GPU's step, so that the peers'
steps cost the same however many share this machine's cores; and the batch is small
(``BATCH``), where 3 peers' samples help most (``scripts/bench/speedup`` paces its steps
and uses mnist1d at batch 4 for the same reason). It then prints, in 80 columns: each run's
test accuracy, the time from its submission until a closed round first reached one peer's
final accuracy, its wall time (the figures its progress line showed), the ensemble's best
member alone, what this one machine can and cannot show, and the commands for real machines.
The ensemble runs first: its time includes the peers' start (their workers load torch).
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
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ttpeer._parser import DEFAULT_BITS
from ttpeer.errors import TtpeerError

READY_TIMEOUT = 60.0
PEER_THREADS = 1  # torch's threads in each process started (OMP_NUM_THREADS): they share the cores
STEP_S = 0.02  # every inner step of the demo's peers lasts this long (emulated compute, ``--step-s``)
BATCH = 8  # the demo's batch a step and peer
SPAN = 80  # a peer's steps per demo round: an ensemble unit, and ROUND_STEPS-step fused rounds
ROUND_STEPS = 20  # a fused round of the demo, in steps a peer
DEFAULT_ROUNDS = 8  # ``ttpeer demo --rounds``'s default: 640 steps a peer, about a minute in all
WIDTH = 80  # the widest line the demo prints

Command = Callable[..., list[str]]
"""Runs one ttpeer command (``command("export", JOB, OUT, "--home", HOME)``) and returns
its output lines; raises ``TtpeerError`` if it fails (``ttpeer.cli.run``)."""


@dataclass
class Outcome:
    """A finished job as ``run_job`` saw it. ``wall_s``: from just before its submission until
    every peer reported it done; ``curve``: (seconds on that clock when a closed round was
    first seen, its test metric), a row per round."""

    label: str
    accuracy: float
    wall_s: float
    bytes_wire: int
    ratio: float | None
    hashes: list[str]
    best_member: float | None = None  # ensemble jobs: the best single member's test metric
    curve: list[tuple[float, float]] = field(default_factory=list)

    def time_to(self, target: float) -> float | None:
        """Seconds until a closed round was first seen at or above ``target``; None: never."""
        return next((t for t, metric in self.curve if metric >= target), None)


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
    from ttpeer.daemon import ask, control

    return ask(home / "control.sock", control.Status(), timeout=10).status


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
    """A fused mnist1d job at batch 64 for tests and benches (``ttpeer_harness.job_spec``):
    ``rounds`` fixed rounds of 6 shards x 60 steps that wait, with the outer step each close
    picks (``outer_auto`` 2: by the pool's size and agreement), as ``ttpeer submit`` gives."""
    return {"task": "mnist1d", "mode": "fused", "rounds": rounds, "shards": 6, "batches": 60, "batch_size": 64,
            "inner_lr": 2e-3, "weight_decay": 0.01, "outer_lr": 0.7, "outer_momentum": 0.0, "outer_auto": 2,
            "bits": DEFAULT_BITS, "seed": 0, "lease": 10.0, "steal": True}


def ensemble_spec(rounds: int, members: int = 3) -> dict[str, Any]:
    """An ensemble with ``job_spec(rounds)``'s data budget: members x rounds x 120 steps
    = rounds x 6 shards x 60 steps when members = 3."""
    fused = {k: v for k, v in job_spec(rounds).items() if k != "outer_auto"}  # members have no outer step
    return {**fused, "mode": "ensemble", "members": members, "shards": None,
            "batches": 360 // members}


def paced_spec(rounds: int, shards: int) -> dict[str, Any]:
    """The demo's fused job: ``rounds`` x ``SPAN`` steps a shard at ``BATCH``, in rounds of
    ``ROUND_STEPS`` that overlap, with the outer step each close picks (as ``ttpeer submit``
    runs a fused job); ``shards``: one a peer."""
    return {**job_spec(rounds * SPAN // ROUND_STEPS), "shards": shards, "batches": ROUND_STEPS,
            "batch_size": BATCH, "overlap": 1}


def paced_ensemble_spec(rounds: int, members: int = 3) -> dict[str, Any]:
    """The demo's ensemble: ``members`` members of ``rounds`` units x ``SPAN`` steps at
    ``BATCH``, so a member trains the steps a peer trains in ``paced_spec(rounds, ...)``."""
    return {**ensemble_spec(rounds, members), "batches": SPAN, "batch_size": BATCH}


def run_job(homes: list[Path], spec: dict[str, Any], label: str, command: Command, progress: Any = None) -> Outcome:
    """Submit ``spec`` from ``homes[0]``, wait until every peer in ``homes`` has it done, export
    the model on each (its sha256 in ``hashes``). ``progress``: a rich ``Progress`` built by
    ``progress_bar``, given a line for the job that shows what the ``Outcome`` will say."""
    from ttpeer.daemon import ask, control

    sent_before = sum(status(h)["bytes_sent"] for h in homes)  # counters are per daemon, not per job
    started = time.monotonic()
    unit = "units" if spec["mode"] == "ensemble" else "rounds"
    task = (progress.add_task(label, total=spec["rounds"], t0=started, wall=None, unit=unit, metric="")
            if progress else None)
    job = ask(homes[0] / "control.sock", control.Submit(spec), timeout=120).job
    seen: dict[int, tuple[float, float]] = {}

    def done() -> bool:
        first = _job(homes[0], job)
        if first is None:
            return False
        for row in first.get("history") or []:
            if row["eval_metric"] is not None and row["round"] not in seen:
                seen[row["round"]] = (time.monotonic() - started, row["eval_metric"])
        if progress:
            progress.update(task, completed=first["round"], total=first["rounds"],
                            metric="" if first["eval_metric"] is None else f"acc {first['eval_metric']:.3f}")
        # "done" once each peer has written its final model (status says "finishing" before)
        return first["state"] == "done" and all((j := _job(h, job)) is not None and j["state"] == "done"
                                                for h in homes[1:])

    wait_for(done, 600, f"job {job[:12]} to finish on every peer", poll=0.2)
    wall = time.monotonic() - started
    finals = [status(h) for h in homes]
    mine = [j for j in finals[0]["jobs"] if j["id"] == job][0]
    if progress:
        progress.update(task, completed=mine["round"], wall=wall)
    hashes = [command("export", job, str(h / "model.safetensors"), "--home", str(h))[-1] for h in homes]
    ratios = [j["compression_ratio"] for st in finals for j in st["jobs"] if j["id"] == job and j["compression_ratio"]]
    best = None
    if spec["mode"] == "ensemble":
        side = json.loads((homes[0] / "model.json").read_text())
        best = max(m[side["metric_name"]] for m in side["members"])
    return Outcome(label, mine["eval_metric"], wall, sum(st["bytes_sent"] for st in finals) - sent_before,
                   sum(ratios) / len(ratios) if ratios else None, hashes, best,
                   [seen[r] for r in sorted(seen)])


def _job(home: Path, job: str) -> dict[str, Any] | None:
    return next((j for j in status(home)["jobs"] if j["id"] == job), None)


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


def run_demo(command: Command, rounds: int = DEFAULT_ROUNDS, keep: bool = False) -> int:
    """The demo, printed on the terminal in at most ``WIDTH`` columns; ``rounds``: each job's
    length, ``rounds`` x ``SPAN`` steps a peer. Returns 0, or 1 when the peers of a job
    exported models that differ."""
    from rich.console import Console

    console = Console(width=min(WIDTH, Console().width), highlight=False)
    paced = ("--step-s", repr(STEP_S))
    with temporary_cluster(keep) as cluster:
        console.print("[bold]ttpeer demo[/]: a relay and 4 peers, each a process on 127.0.0.1")
        url, fp = cluster.start_relay()
        console.print(f"relay ready at {url} ({fp[:23]}...)")
        pool = make_pool(cluster, url, fp, ["alice", "bob", "carol"], paced, command=command)
        alone = make_pool(cluster, url, fp, ["solo"], paced, command=command)
        console.print("alice, bob and carol enrolled in one pool; solo alone in another")
        console.print(f"mnist1d at batch {BATCH}, {rounds * SPAN} steps a peer, each paced to {STEP_S * 1000:.0f} ms "
                      "as if on a GPU")
        with progress_bar(console) as progress:
            ensemble = run_job(pool, paced_ensemble_spec(rounds), "ensemble, 3 members", command, progress)
            solo = run_job(alone, paced_spec(rounds, 1), "one peer alone", command, progress)
            fused = run_job(pool, paced_spec(rounds, 3), "fused pool, 3 peers", command, progress)
    identical = len(set(fused.hashes)) == 1 and len(set(ensemble.hashes)) == 1
    print_report(console, solo, fused, ensemble, rounds * SPAN)
    return 0 if identical else 1


def progress_bar(console: Any) -> Any:
    """A rich ``Progress`` for ``run_job``: a line a job, its rounds, its latest test accuracy
    and its seconds so far, which stop at the job's ``wall_s`` when it is done."""
    from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
    from rich.table import Column
    from rich.text import Text

    class Seconds(ProgressColumn):
        def render(self, task: Any) -> Text:
            wall = task.fields["wall"]
            return Text(_secs(time.monotonic() - task.fields["t0"] if wall is None else wall), justify="right")

    return Progress(TextColumn("{task.description}", table_column=Column(width=19)), BarColumn(bar_width=16),
                    TextColumn("{task.completed:>2.0f}/{task.total:.0f} {task.fields[unit]}",
                               table_column=Column(width=12)),
                    TextColumn("{task.fields[metric]}", table_column=Column(width=9)),
                    Seconds(table_column=Column(width=7, justify="right")), console=console)


def print_report(console: Any, solo: Outcome, fused: Outcome, ensemble: Outcome, steps: int) -> None:
    """The results table, what it shows, what one machine cannot show, and what to run next."""
    from rich.table import Table

    target = solo.accuracy
    table = Table(title=f"mnist1d, batch {BATCH}: {steps} steps a peer, each paced to {STEP_S * 1000:.0f} ms",
                  caption=f"{target:.3f}: one peer's final accuracy; times count from each submission")
    for col in ("run", "test accuracy", f"time to {target:.3f}", "wall time"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for o in (solo, fused, ensemble):
        reached = o.time_to(target)
        table.add_row(o.label, f"{o.accuracy:.3f}", "not reached" if reached is None else _secs(reached),
                      _secs(o.wall_s))
    table.add_row("  its best member alone", "-" if ensemble.best_member is None else f"{ensemble.best_member:.3f}",
                  "-", "-")
    console.print(table)
    cores = os.cpu_count() or 1
    for text in (*findings(solo, fused, ensemble), "",
                 f"This one machine shows the rounds and the averaging, not real machines' speed: its 4 peers "
                 f"share {cores} core{'s' if cores > 1 else ''} with no network between them, and each paced step "
                 "stands for a GPU's.", "",
                 "Next, on real machines (README.md, \"Across real machines\"):"):
        for line in textwrap.wrap(text, console.width) or [""]:
            console.print(line, markup=False)
    for line in NEXT_STEPS:
        console.print(line, markup=False)


NEXT_STEPS = (
    "  ttpeer relay --listen 0.0.0.0:8443 --data ./relay-data   # a box all reach",
    "  ttpeer pool create --relay https://HOST:8443 --fingerprint sha256:... --uses 2",
    "  ttpeer up                       # on that first machine: its daemon",
    "  ttpeer join -                   # on each other machine: paste the token",
    "  ttpeer advise --task mnist1d --peers 3   # will 3 machines help this job?",
)


def findings(solo: Outcome, fused: Outcome, ensemble: Outcome) -> list[str]:
    """What the table shows, in sentences that hold whichever way the runs went."""
    lone = solo.time_to(solo.accuracy) or solo.wall_s
    reached = fused.time_to(solo.accuracy)
    pool = (f"The fused pool of 3 reached one peer's final accuracy in {_secs(reached)}, {reached / lone:.2f}x "
            f"one peer's {_secs(lone)}, " if reached is not None else
            f"The fused pool of 3 did not reach one peer's final accuracy in {_secs(fused.wall_s)}, ")
    lines = [f"{pool}and ended at {fused.accuracy:.3f} on the same steps a peer."]
    if ensemble.best_member is not None:
        beat = "beat" if ensemble.accuracy > ensemble.best_member else "did not beat"
        lines.append(f"The ensemble's vote, {ensemble.accuracy:.3f}, {beat} its best member alone, "
                     f"{ensemble.best_member:.3f}. It ran first: its times include the peers' start.")
    same = [f"the {what} (sha256 {o.hashes[0][:16]}...)" for o, what in ((fused, "fused model"),
                                                                      (ensemble, "ensemble bundle"))
            if len(set(o.hashes)) == 1]
    differ = [what for o, what in ((fused, "fused model"), (ensemble, "ensemble bundle")) if len(set(o.hashes)) > 1]
    if same:
        lines.append("Bit-identical on the 3 peers: " + " and ".join(same) + ".")
    if differ:
        lines.append("DIFFERENT on the 3 peers: the " + " and the ".join(differ) + ".")
    return lines


def _secs(seconds: float) -> str:
    return f"{seconds:.1f} s"
