"""A worker process: where task code and torch run, one job per process.

Theory of operation. The daemon spawns ``python -m ttpeer.daemon._worker`` (a fresh
interpreter, never a fork of the daemon) and speaks to it over the process's stdin
and stdout with ``_channel`` frames. The worker first moves the channel off fds 0
and 1 (a task that prints must not corrupt it: its output goes to stderr, the
daemon's log), imports torch, and says ``hello`` with what it found (torch version,
devices). The daemon then sends a ``config`` frame (home, device, memory limit, task
options) and requests: each is one call of the executor interface
(``daemon/_executor.py``), served by the same ``TorchExecutor`` that runs in-process
in tests, so both paths train identically. Requests run concurrently as tasks (a
round's close runs while the next round trains), each reply names its request.

Large values never enter a frame: deltas, states and task files are files in the
home (``HOME/work/<job>/``, written atomically), and a frame names them. A shard in
training reports its progress (batches started) at most every ``PROGRESS_EVERY``
seconds, which is also the heartbeat the daemon's step timeout watches; a
``cancel`` frame stops it before its next batch.

Everything task code can raise is answered as a failure frame with a kind the
daemon matches (never words): ``task`` (the task's code failed: the job fails on
this peer), ``oom`` (CUDA ran out of memory), ``state_missing``, ``disk``, ``job``,
``dataset`` (the task asked for a dataset not held here: the daemon fetches it).
The worker exits when its channel closes: a daemon that dies, even by SIGKILL, closes
it, and the worker's event loop (torch runs in threads) sees that at once, so no
worker outlives its daemon. (``PR_SET_PDEATHSIG`` would not do: it fires when the
*thread* that spawned the child ends, and trio spawns from a cached worker thread.)
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import trio
import trio.lowlevel

from ttpeer._trim import trim
from ttpeer.proto import Outer

from ._channel import ChannelError, FrameReader, send

PROGRESS_EVERY = 0.1
log = logging.getLogger("ttpeer.worker")


# Calls that allocate model-sized memory: the worker's resident set is trimmed after each.
_LARGE = frozenset({"new_job", "prepare", "train", "delta", "reduce_slice", "aggregate", "apply", "export_state",
                    "import_state", "finish"})


def main() -> None:
    # Ctrl-C at a terminal signals the whole foreground process group: the daemon hands
    # back its claims and then ends its workers itself, so a worker takes no SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    chan_in, chan_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)  # print() in task code goes to the log, not into the channel
    os.close(null)
    logging.basicConfig(stream=sys.stderr, level=os.environ.get("TTPEER_WORKER_LOG", "WARNING"),
                        format=f"%(asctime)s worker {os.getpid()} %(levelname)s %(name)s: %(message)s")
    try:
        trio.run(_serve, chan_in, chan_out)
    except (KeyboardInterrupt, trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the daemon went away: nobody is left to tell
    except ChannelError as exc:
        log.error("closing: %s", exc)
        os._exit(2)
    os._exit(0)


class _Worker:
    def __init__(self, out: trio.lowlevel.FdStream) -> None:
        self._out = out
        self._lock = trio.Lock()
        self.executor: Any = None
        self._records: dict[str, Any] = {}
        self._runs: dict[int, _Run] = {}

    async def send(self, obj: dict[str, Any]) -> None:
        async with self._lock:
            await send(self._out, obj)

    def record(self, raw_hex: str) -> Any:
        from ttpeer.proto import parse

        rec = self._records.get(raw_hex)
        if rec is None:
            rec = self._records[raw_hex] = parse(bytes.fromhex(raw_hex))
        return rec

    def cancel(self, rid: int) -> None:
        run = self._runs.get(rid)
        if run is not None:
            run.cancelled = True

    async def handle(self, msg: dict[str, Any]) -> None:
        rid = msg["id"]
        log.debug("request %d: %s", rid, msg["op"])
        try:
            result = await self._dispatch(rid, msg["op"], msg.get("args", {}))
            if msg["op"] in _LARGE:
                trim()  # what the call freed goes back to the system, not to glibc's heaps
            reply: dict[str, Any] = {"id": rid, "ok": result}
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a frame
            if isinstance(exc, trio.Cancelled | KeyboardInterrupt | SystemExit):
                raise
            reply = {"id": rid, **failure(exc)}
        log.debug("reply %d: %s", rid, "ok" if "ok" in reply else reply["error"])
        await self.send(reply)

    async def _dispatch(self, rid: int, op: str, a: dict[str, Any]) -> Any:
        from ttpeer.proto import PublishDelta, Train

        from ._workfiles import write_work

        ex = self.executor
        if op == "warm":  # a spare, while it waits: torch's meta kernels, the default task's data
            await ex.warm_up()
            return None
        if op == "group":
            import torch

            torch.set_num_threads(a["threads"])
            await ex.join_group(Path(a["store"]), a["rank"], a["world"], a["device"])
            return None
        if op == "forget":  # the job finished: drop its model, keep the process for the next
            await ex.release(a["job"])
            await trio.to_thread.run_sync(_free_memory)
            return None
        if op == "new_job":
            fixed, init = await ex.new_job(a["spec"], _read_opt(a.get("task_file")))
            return {"fixed": fixed, "file": str(write_work(Path(a["out"]), init))}
        job = self.record(a["job"])
        if op == "prepare":
            decline = await ex.prepare(job, _read_opt(a.get("task_file")))
            if decline is None or isinstance(decline, str):
                return decline
            return {"reason": decline.reason, "need": decline.need, "have": decline.have, "code": decline.code}
        if op == "train":
            eff = Train(job, a["round"], a["shard"], a["attempt"], a["base"], a["fresh"], a.get("steps"),
                        a.get("first_step"), a.get("ahead"))
            run = self._runs[rid] = _Run()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._report_progress, rid, run)
                    try:
                        return await ex.train(eff, run.should_stop)
                    except Exception as exc:  # out of the nursery as itself, not in a group
                        failed = exc
                    finally:
                        nursery.cancel_scope.cancel()
            finally:
                self._runs.pop(rid, None)
            raise failed
        if op == "pieces":
            return await ex.pieces(job, a["round"], a["shards"], a["steps"], a["first"])
        if op == "delta":
            publish = PublishDelta(job, a["round"], a["base"], tuple(a["shards"]), a["samples"])
            data, metrics = await ex.delta(publish)
            if a.get("rank", 0) > 0:  # its copy is the same as the first worker's: keep one
                return {"file": None, "metrics": metrics}
            return {"file": str(write_work(Path(a["out"]), data)), "metrics": metrics}
        if op in ("aggregate", "apply", "reduce_slice"):
            # Paths, read one at a time by the outer step; whoever wrote them removes them.
            deltas = [(Path(p), samples) for p, samples in a["deltas"]]
            sliced = bool(a.get("sliced"))
            outer = Outer(*a["outer"]) if a.get("outer") else None
            if op == "reduce_slice":
                data = await ex.reduce_slice(job, deltas, a["first"], a["stop"], rnd=a["round"])
                return {"file": str(write_work(Path(a["out"]), data))}
            if op == "apply":
                return await ex.apply(job, a["base"], deltas, a["expect"], rnd=a["round"], sliced=sliced, outer=outer)
            state, metrics = await ex.aggregate(job, a["base"], deltas, rnd=a["round"], sliced=sliced, outer=outer)
            return {"state": state, "metrics": metrics}
        if op == "export_state":  # file to file: the worker never holds the state's bytes
            await ex.export_state(job, a["state"], Path(a["out"]))
            return a["out"]
        if op == "import_state":
            try:
                return await ex.import_state(job, a["state"], Path(a["file"]))
            finally:
                Path(a["file"]).unlink(missing_ok=True)
        if op == "finish":
            await ex.finish(job, a["state"], a["metrics"])
            return None
        raise ValueError(f"unknown worker op {op!r}")

    async def _report_progress(self, rid: int, run: _Run) -> None:
        sent = 0
        while True:
            await trio.sleep(PROGRESS_EVERY)
            if run.calls != sent:
                sent = run.calls
                await self.send({"id": rid, "progress": sent})


class _Run:
    """A shard in training: batches started (written by the torch thread), and whether
    the daemon asked it to stop."""

    def __init__(self) -> None:
        self.calls = 0
        self.cancelled = False

    def should_stop(self) -> bool:
        self.calls += 1
        return self.cancelled


def _free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _read_opt(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def failure(exc: BaseException) -> dict[str, Any]:
    """The failure frame for ``exc``: a kind the daemon matches, and a message for people."""
    from ttpeer.errors import DiskError, JobError, StateMissing, TaskFailed

    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]  # a nursery's wrapping says nothing of what failed
    oom = _cuda_oom(exc)
    if oom is not None:
        return {"error": "oom", "message": oom}
    if isinstance(exc, TaskFailed):
        return {"error": "task", "message": exc.reason}
    from ttpeer.proto import DatasetMissing

    if isinstance(exc, DatasetMissing):
        return {"error": "dataset", "message": str(exc), "name": exc.name, "dataset": exc.dataset,
                "pieces": exc.pieces[:4096], "whole": exc.whole, "moved": exc.moved}
    if isinstance(exc, StateMissing):
        return {"error": "state_missing", "message": str(exc), "state": exc.state}
    if isinstance(exc, DiskError):
        return {"error": "disk", "message": str(exc), "path": str(exc.path)}
    if isinstance(exc, JobError):
        return {"error": "job", "message": str(exc)}
    if isinstance(exc, OSError):  # the worker's own files: the disk's problem, not the task's
        from ._workfiles import DISK_ERRNOS

        if exc.errno in DISK_ERRNOS:
            return {"error": "disk", "message": exc.strerror or str(exc), "path": str(exc.filename or "")}
        return {"error": "job", "message": f"{exc.filename or 'a file'}: {exc.strerror or exc}"}
    # Nothing else should reach here (the executor translates task code's exceptions);
    # if it does, it is still the task's failure on this peer, never the daemon's.
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {Path(where[0].filename).name}:{where[0].lineno})" if where else ""
    log.error("unexpected error in the worker", exc_info=exc)
    return {"error": "task", "message": f"{type(exc).__name__}: {exc}{at}"}


def _cuda_oom(exc: BaseException) -> str | None:
    """The message for CUDA running out of memory anywhere in ``exc``'s chain, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    seen: BaseException | None = exc
    while seen is not None:
        if oom_type is not None and isinstance(seen, oom_type):
            device = _device_in(str(seen))
            return (f"out of GPU memory on {device}: try a smaller --micro-batch / --batch-size "
                    f"({str(seen).splitlines()[0][:200]})")
        seen = seen.__cause__ or seen.__context__
    return None


def _device_in(text: str) -> str:
    import re

    found = re.search(r"GPU (\d+)", text)
    return f"cuda:{found.group(1)}" if found else "the GPU"


async def _serve(fd_in: int, fd_out: int) -> None:
    out = trio.lowlevel.FdStream(fd_out)
    reader = FrameReader(trio.lowlevel.FdStream(fd_in))
    worker = _Worker(out)
    import torch

    await worker.send({"hello": {"pid": os.getpid(), "torch": torch.__version__,
                                 "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}})
    config = await reader.read()
    if config is None:
        return
    from ._home import Home
    from ._torch import TorchExecutor

    c = config["config"]
    worker.executor = TorchExecutor(Home(Path(c["home"])), device=c["device"], task_options=c.get("task_options"),
                                    memory_limit=c.get("memory_limit"))
    async with trio.open_nursery() as nursery:
        while (msg := await reader.read()) is not None:
            if msg.get("op") == "cancel":
                worker.cancel(msg["id"])
            else:
                nursery.start_soon(worker.handle, msg)
        # The daemon closed the channel (it stops, or gave up on this worker): leave now,
        # without waiting for a step in a torch thread. Every file that matters was
        # written atomically, so nothing is torn.
        os._exit(0)


if __name__ == "__main__":
    main()
