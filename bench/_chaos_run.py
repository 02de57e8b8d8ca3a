"""One chaos run on real processes: two relays, a pool of daemons, a job, the faults.

``Pool`` owns the processes (each ``ttpeer`` in its own session, its output appended to
``ROOT/NAME.log`` across restarts), every peer's ``Gate`` (its only way to the relays)
and a journal of what was done to whom. ``execute(plan, root, proxies)`` builds the pool,
submits the job, applies each fault at its time and undoes it after its hold, waits for
the job to end (bounded), and returns a ``Result`` for ``_chaos_check`` to judge.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ttpeer.daemon import call
from ttpeer.errors import TtpeerError
from ttpeer_harness import READY_TIMEOUT, status, ttpeer, wait_for

from ._chaos_faults import BAD_TASK, corrupt, fill, workers_of
from ._chaos_plan import NEEDS_ROOT, Fault, Plan
from ._chaos_proxy import Gate, Proxies

STEP_S = "0.05"  # every training step lasts this long (emulated compute, as a GPU's step would)
JOB_BOUND = 240.0  # seconds from submit within which the job must have ended on every survivor
KILLED = "killed (SIGKILL)"  # why a peer killed for good is gone (res.exits); a restart removes it
ADMIN_FAULTS = ("revoke", "join", "bad_task")  # carried out by commands on the admin's home
TMPFS_SIZE = "48m"


@dataclass
class Result:
    """What a run left for the checkers."""

    plan: Plan
    root: Path
    job: str | None = None
    bad_job: str | None = None
    homes: dict[str, Path] = field(default_factory=dict)
    survivors: list[str] = field(default_factory=list)  # peers that must finish the job
    exits: dict[str, str] = field(default_factory=dict)  # name -> why it may have exited
    unexpected: list[str] = field(default_factory=list)  # processes that exited on their own
    skipped: list[str] = field(default_factory=list)  # faults not injected, with why
    disk_exits: list[str] = field(default_factory=list)  # peers that exited on their full disk
    procs_rc: dict[str, int | None] = field(default_factory=dict)  # each process's exit status at the end
    journal: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None  # the run could not be carried out (set-up failed): a violation too


class Pool:
    """The processes of one run."""

    def __init__(self, root: Path, proxies: Proxies) -> None:
        self.root = root
        self.proxies = proxies
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.gates: dict[str, Gate] = {}
        self.relay_ports: dict[str, int] = {}
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "TTPEER_CONFIG": str(root / "ttpeer.toml")}
        for key in ("TTPEER_HOME", "HTTPS_PROXY", "https_proxy", "TTPEER_TOKEN"):
            self.env.pop(key, None)
        self.mounts: list[Path] = []
        self.t0 = time.monotonic()

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.log(name), "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "ttpeer", *args], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**self.env, **(env or {})},
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_relay(self, name: str, port: int = 0) -> tuple[str, str]:
        log = self.log(name)
        seen = log.stat().st_size if log.exists() else 0
        proc = self.spawn(name, "relay", "--listen", f"127.0.0.1:{port}", "--data", str(self.root / name))
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            with open(log, "rb") as f:
                f.seek(seen)
                for line in f.read().decode(errors="replace").splitlines():
                    if line.startswith("relay ready "):
                        _, _, url, fp = line.split()
                        self.relay_ports[name] = int(url.rsplit(":", 1)[1])
                        return url, fp
            if proc.poll() is not None:
                raise TtpeerError(f"{name} exited early (see {log})")
            time.sleep(0.05)
        raise TtpeerError(f"{name} did not report ready in time")

    def up(self, name: str, home: Path) -> None:
        self.spawn(name, "up", "--home", str(home), "--step-s", STEP_S, env={"HTTPS_PROXY": self.gate(name).url})

    def join(self, name: str, home: Path, token: str) -> None:
        self.spawn(name, "join", "--name", name, "--home", str(home), "--step-s", STEP_S,
                   env={"HTTPS_PROXY": self.gate(name).url, "TTPEER_TOKEN": token})

    def gate(self, name: str) -> Gate:
        if name not in self.gates:
            self.gates[name] = self.proxies.gate()
        return self.gates[name]

    def mount_tmpfs(self, home: Path) -> None:
        home.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0700", "tmpfs", str(home)],
                       check=True, capture_output=True)
        self.mounts.append(home)

    def close(self) -> None:
        for proc in self.procs.values():  # SIGSTOPped groups must be continued to hear SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
        from ttpeer_harness import stop_processes

        stop_processes(list(self.procs.values()))
        for home in self.mounts:  # a copy stays to read (the tmpfs goes with the unmount)
            with contextlib.suppress(shutil.Error, OSError):  # sockets and the like are not copied
                shutil.copytree(home, home.with_name(home.name + "-tmpfs"), dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("chaos-fill", "*.sock"))
            subprocess.run(["umount", "-l", str(home)], check=False, capture_output=True)


class Runner:
    """Carries out one plan on a ``Pool``."""

    def __init__(self, plan: Plan, root: Path, proxies: Proxies, *, root_user: bool) -> None:
        self.plan = plan
        self.pool = Pool(root, proxies)
        self.res = Result(plan, root)
        self.root_user = root_user
        self.rng = random.Random(f"ttpeer-chaos-apply:{plan.seed}")
        self.names = plan.names[: plan.peers]
        self.relays: dict[str, tuple[str, str]] = {}
        self.undone: set[Fault] = set()
        self.admin_failures: list[str] = []

    def note(self, what: str) -> None:
        self.res.journal.append(f"{time.monotonic() - self.pool.t0:6.1f}s {what}")

    # -- set-up ------------------------------------------------------------------------

    def build(self) -> None:
        root = self.res.root
        for i in range(2):
            self.relays[f"relay{i}"] = self.pool.start_relay(f"relay{i}")
        (url0, fp0), (url1, fp1) = self.relays["relay0"], self.relays["relay1"]
        homes = {name: root / name for name in self.names}
        self.res.homes = dict(homes)
        if self.plan.tmpfs_peer is not None:
            self.pool.mount_tmpfs(homes[self.names[self.plan.tmpfs_peer]])
        admin = homes[self.names[0]]
        ttpeer("pool", "create", "--relay", url0, "--fingerprint", fp0, "--name", self.names[0],
               "--home", str(admin))
        self.pool.up(self.names[0], admin)
        wait_for(lambda: status(admin)["node"]["has_pool_key"], READY_TIMEOUT, "the admin to start")
        ttpeer("relay", "add", url1, "--fingerprint", fp1, "--home", str(admin))
        token = ttpeer("invite", "--uses", str(self.plan.peers - 1), "--home", str(admin))[-1]
        self.res.tokens.append(token)
        for name in self.names[1:]:
            self.pool.join(name, homes[name], token)

        def all_in() -> bool:
            return all(status(h)["node"]["has_pool_key"] and len(status(h)["peers"]) == len(homes)
                       and len(status(h)["relays"]) == 2 for h in homes.values())

        wait_for(all_in, 2 * READY_TIMEOUT, f"{len(homes)} peers on both relays", poll=0.25)
        self.note(f"pool of {len(homes)} on two relays")

    def submit(self) -> None:
        admin = self.res.homes[self.names[0]]
        p = self.plan
        args = ["submit", "--task", "mnist1d", "--rounds", str(p.rounds), "--inner-steps", str(p.inner_steps),
                "--batch-size", "32", "--lease", "8s", "--home", str(admin)]
        if p.mode == "ensemble":
            args += ["--mode", "ensemble", "--members", "2"]
        else:
            args += ["--shards", str(p.peers)]
        self.res.job = ttpeer(*args)[-1]
        self.pool.t0 = time.monotonic()
        self.note(f"submitted {p.mode} job {self.res.job[:12]}: {p.rounds} rounds of {p.inner_steps} steps")

    # -- faults ------------------------------------------------------------------------

    def events(self) -> list[tuple[float, str, Fault]]:
        out: list[tuple[float, str, Fault]] = []
        for f in self.plan.faults:
            if f.kind in NEEDS_ROOT and not self.root_user:
                self.res.skipped.append(f"{f.describe(self.plan.names)}: skipped ({NEEDS_ROOT[f.kind]})")
                continue
            out.append((f.at, "do", f))
            if f.hold is not None:
                out.append((f.at + f.hold, "undo", f))
        return sorted(out, key=lambda e: e[0])

    def apply(self, phase: str, f: Fault) -> None:
        name = self.plan.names[f.target]
        home = self.res.homes.get(name)
        proc = self.pool.procs.get(name)
        if f.kind in ("kill", "stop", "kill_worker") and phase == "do" and (proc is None or proc.poll() is not None):
            self.res.skipped.append(f"{f.describe(self.plan.names)}: {name} had exited")  # revoked, or its disk filled
            return
        if f.kind == "stop" and phase == "undo" and (proc is None or proc.poll() is not None):
            self.undone.add(f)  # it exited while stopped (a revocation heard at SIGCONT): nothing to continue
            return
        if phase == "undo":
            self.undone.add(f)
        if f.kind == "kill":
            if phase == "do":
                assert proc is not None
                self.res.exits[name] = KILLED
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            else:
                assert home is not None
                self.pool.up(name, home)
                self.res.exits.pop(name, None)
        elif f.kind == "stop":
            assert proc is not None
            os.killpg(proc.pid, signal.SIGSTOP if phase == "do" else signal.SIGCONT)
        elif f.kind == "kill_worker":
            assert proc is not None
            self._kill_worker(name, proc.pid)
            return
        elif f.kind in ("relay_restart", "relay_kill"):
            relay = f"relay{f.target}"
            if phase == "do":
                self.pool.procs[relay].kill()
                self.pool.procs[relay].wait()
                if f.kind == "relay_restart":
                    for item in (self.res.root / relay).iterdir():
                        if item.name != "tls":
                            shutil.rmtree(item) if item.is_dir() else item.unlink()
                else:
                    self.res.exits[relay] = "killed for good"
            else:
                self.pool.start_relay(relay, self.pool.relay_ports[relay])
        elif f.kind == "disk_full":
            assert home is not None
            if phase == "do":
                self.note(f"filled {name}'s home with {fill(home) >> 20} MiB")
                self.res.exits[name] = "disk full"
                return
            (home / "chaos-fill").unlink()
            if proc is not None and proc.poll() is not None:
                self.note(f"{name} had exited ({proc.returncode}) on the full disk; started again")
                self.res.disk_exits.append(name)
                self.pool.up(name, home)
            self.res.exits.pop(name, None)
        elif f.kind == "cut":
            gate = self.pool.gate(name)
            gate.cut(f.silent) if phase == "do" else gate.mend()
        elif f.kind == "corrupt_blob":
            blob = None
            for relay in (f"relay{f.target}", f"relay{1 - f.target}"):  # blobs go to the first live relay
                if relay not in self.res.exits and (blob := corrupt(self.res.root / relay, self.rng)) is not None:
                    break
            if blob is None:
                self.res.skipped.append(f"{f.describe(self.plan.names)}: no blob on a live relay yet")
                return
            self.note(f"corrupted blob {blob} on {relay}")
            return
        elif f.kind == "revoke":
            self.res.exits[name] = "revoked"
            self._admin("revoke", name)
        elif f.kind == "join":
            token = self._admin("invite", "--uses", "1")[-1]
            self.res.tokens.append(token)
            late = self.res.root / "late"
            self.res.homes["late"] = late
            self.pool.join("late", late, token)
        elif f.kind == "bad_task":
            task = self.res.root / "broken_task.py"
            task.write_text(textwrap.dedent(BAD_TASK))
            self.res.bad_job = self._admin("submit", "--task", str(task), "--rounds", "2", "--shards", "2",
                                           "--inner-steps", "5", "--batch-size", "16")[-1]
        self.note(f"{phase} {f.describe(self.plan.names)}")

    def _admin(self, *args: str) -> list[str]:
        """A command on the admin's home; retried while the admin does not answer (it may
        be stopped or cut by another fault), up to 60 s."""
        admin = self.res.homes[self.names[0]]
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                return wait_for(lambda: ttpeer(*args, "--home", str(admin)), 60, f"'ttpeer {args[0]}' on the admin",
                                poll=1.0)
        except TtpeerError as exc:
            last = said.getvalue().strip().splitlines()[-1:] or ["nothing on stderr"]
            raise TtpeerError(f"{exc}; it said: {last[0]}") from None

    def _admin_faults(self, faults: queue.Queue[Fault | None]) -> None:
        while (fault := faults.get()) is not None:
            try:
                self.apply("do", fault)
            except (TtpeerError, OSError) as exc:
                self.admin_failures.append(f"{fault.describe(self.plan.names)}: {exc}")

    def _job_over(self) -> bool:
        """Whether the first peer that answers within 2 s (a stopped one does not) has the job ended."""
        for name in self.names:
            if name in self.res.exits:
                continue
            try:
                st = call(self.res.homes[name] / "control.sock", {"op": "status"}, timeout=2)["status"]
            except (TtpeerError, OSError):
                continue
            job = next((j for j in st["jobs"] if j["id"] == self.res.job), None)
            return job is not None and job["state"] in ("done", "failed", "cancelled")
        return False

    def _kill_worker(self, name: str, pid: int) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            kids = workers_of(pid)
            if kids:
                victim = self.rng.choice(kids)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
                self.note(f"killed {name}'s worker {victim}")
                return
            time.sleep(0.2)
        self.res.skipped.append(f"kill_worker({name}): no worker running within 10 s")

    # -- the whole run -----------------------------------------------------------------

    def run(self) -> Result:
        started = time.monotonic()
        try:
            self.build()
            self.submit()
            # The admin's commands (revoke, invite, submit) wait while the admin does not answer
            # (stopped or cut by another fault): they run in order on a thread of their own, so
            # the schedule's other faults, and their undoing, keep their times.
            admin_queue: queue.Queue[Fault | None] = queue.Queue()
            admin_thread = threading.Thread(target=self._admin_faults, args=(admin_queue,), daemon=True)
            admin_thread.start()
            for at, phase, fault in self.events():
                delay = self.pool.t0 + at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # the schedule's own clock: faults are due at fixed times
                if phase == "do" and self._job_over():
                    self.res.skipped.append(f"{fault.describe(self.plan.names)}: the job had ended")
                    continue
                if phase == "undo" and any(s.startswith(fault.describe(self.plan.names)) for s in self.res.skipped):
                    continue
                if fault.kind in ADMIN_FAULTS:
                    admin_queue.put(fault)
                else:
                    self.apply(phase, fault)
            admin_queue.put(None)
            admin_thread.join(timeout=150)
            if self.admin_failures:
                raise TtpeerError(self.admin_failures[0])
            lost = [f.describe(self.plan.names) for f in self.plan.faults if f.hold is not None and f not in self.undone
                    and not any(s.startswith(f.describe(self.plan.names)) for s in self.res.skipped)]
            if lost:  # the harness's own check: what it did, it undid
                raise TtpeerError(f"the campaign never undid {', '.join(lost)}")
            self.res.survivors = [n for n in self.names if n not in self.res.exits]
            self._await_end()
        except (TtpeerError, OSError, subprocess.CalledProcessError) as exc:
            self.res.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._release()  # a run cut short leaves nothing stopped or cut for the checkers to wait on
            self.res.unexpected = [f"{n} exited with {p.returncode}" for n, p in self.pool.procs.items()
                                   if p.poll() is not None and n not in self.res.exits]
            self.res.procs_rc = {n: p.poll() for n, p in self.pool.procs.items()}
            self._record_exits()
            self.res.seconds = time.monotonic() - started
        return self.res

    def _await_end(self) -> None:
        job = self.res.job
        assert job is not None
        homes = [self.res.homes[n] for n in self.res.survivors]
        left = JOB_BOUND - (time.monotonic() - self.pool.t0)

        def ended() -> bool:
            states = [state(h, job) for h in homes]
            bad = self.res.bad_job
            # A member killed for good keeps the broken job open for the pool (_chaos_check._broken_job).
            if bad and not (_ended_for_pool(self.res.homes[self.names[0]], bad)
                            or (KILLED in self.res.exits.values() and all(state(h, bad) == "failed" for h in homes))):
                return False
            return all(s in ("done", "failed", "cancelled") for s in states)

        try:
            wait_for(ended, max(left, 1.0), f"job {job[:12]} to end on {', '.join(self.res.survivors)}", poll=0.5)
        except TtpeerError as exc:
            self.res.error = str(exc)
        late = self.res.homes.get("late")
        if late is not None and "late" not in self.res.exits:  # a joiner must get in, whatever else happened
            admin_home = self.res.homes[self.names[0]]
            try:
                wait_for(lambda: status(late)["node"]["has_pool_key"]
                         and any(p["name"] == "late" for p in status(admin_home)["peers"]), 60,
                         "the peer that joined mid-job to be a member", poll=0.5)
            except TtpeerError as exc:
                self.res.error = str(exc)
        admin = next((j for j in status(self.res.homes[self.names[0]])["jobs"] if j["id"] == job), None)
        self.note(f"job ended: {admin and admin['state']}, round {admin and admin['round']}"
                  if self.res.error is None else "job did not end in time")

    def _release(self) -> None:
        for proc in self.pool.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGCONT)
        for gate in self.pool.gates.values():
            gate.mend()

    def _record_exits(self) -> None:
        for name, proc in self.pool.procs.items():
            if proc.poll() is not None:
                self.note(f"{name} exited {proc.returncode} ({self.res.exits.get(name, 'on its own')})")


def job_status(home: Path, job: str | None) -> dict | None:  # type: ignore[type-arg]
    """What ``ttpeer status`` on ``home`` says of ``job``; None when it does not answer or know it."""
    try:
        return next((j for j in status(home)["jobs"] if j["id"] == job), None)
    except (TtpeerError, OSError):
        return None


def _ended_for_pool(home: Path, job: str) -> bool:
    found = job_status(home, job)
    return found is not None and found["ended"] is not None


def state(home: Path, job: str | None) -> str | None:
    found = job_status(home, job)
    return None if found is None else found["state"]
