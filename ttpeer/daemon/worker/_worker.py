"""A worker process: where task code and torch run, one job per process.

Theory of operation. The daemon spawns ``python -m ttpeer.daemon.worker._worker`` (a fresh
interpreter, never a fork of the daemon) and speaks to it over the process's stdin
and stdout with ``_channel`` frames. The worker first moves the channel off fds 0
and 1 (a task that prints must not corrupt it: its output goes to stderr, the
daemon's log), imports torch, and says ``hello`` with what it found (torch version,
devices). The daemon then sends a ``config`` frame (home, device, memory limit, task
options) and requests: each is one call of the executor interface
(``daemon/_executor.py``), a message of ``_workermsg`` with one handler here
(``_HANDLERS``), served by the same ``TorchExecutor`` that runs in-process in tests,
so both paths train identically. Requests run concurrently as tasks (a
round's close runs while the next round trains), each reply names its request.

Large values never enter a frame: deltas, states and task files are files in the
home (``HOME/work/<job>/``, written atomically), and a frame names them. A shard in
training reports its progress (batches started) at most every ``PROGRESS_EVERY``
seconds, which is also the heartbeat the daemon's step timeout watches; a
``cancel`` frame stops it before its next batch.

Everything task code can raise is answered as a failure frame with a kind the
daemon matches (never words), from one table that both ends read (``_failures``).
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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio
import trio.lowlevel

from ttpeer._trim import trim

from .._codec import Message, MessageError
from .._executor import Decline
from .._workfiles import write_work
from . import _workermsg as msg
from ._channel import ChannelError, FrameReader, send
from ._failures import failure
from ._workermsg import CODEC

PROGRESS_EVERY = 0.1
log = logging.getLogger("ttpeer.worker")


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
        self._runs: dict[int, _Run] = {}

    async def send(self, obj: dict[str, Any]) -> None:
        async with self._lock:
            await send(self._out, obj)

    def cancel(self, rid: int) -> None:
        run = self._runs.get(rid)
        if run is not None:
            run.cancelled = True

    async def handle(self, rid: int, request: Message[Any]) -> None:
        log.debug("request %d: %s", rid, request.op)
        try:
            result = await _HANDLERS[type(request)](self, request, rid)
            if type(request) in _LARGE:
                trim()  # what the call freed goes back to the system, not to glibc's heaps
            reply: dict[str, Any] = {"id": rid, "ok": CODEC.to_json(result)}
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a frame
            if isinstance(exc, trio.Cancelled | KeyboardInterrupt | SystemExit):
                raise
            reply = {"id": rid, **failure(exc)}
        log.debug("reply %d: %s", rid, "ok" if "ok" in reply else reply["error"])
        await self.send(reply)

    # -- one handler per request (``_HANDLERS``) ---------------------------------------------

    async def _warm(self, _req: msg.Warm, _rid: int) -> None:
        await self.executor.warm_up()

    async def _join_group(self, req: msg.JoinGroup, _rid: int) -> None:
        import torch

        torch.set_num_threads(req.threads)
        await self.executor.join_group(req.store, req.rank, req.world, req.device)

    async def _forget(self, req: msg.Forget, _rid: int) -> None:
        await self.executor.release(req.job)
        await trio.to_thread.run_sync(_free_memory)

    async def _new_job(self, req: msg.NewJob, _rid: int) -> msg.Built:
        fixed, init = await self.executor.new_job(req.spec, _read_opt(req.task_file))
        return msg.Built(fixed, write_work(req.out, init))

    async def _prepare(self, req: msg.Prepare, _rid: int) -> Decline | str | None:
        return await self.executor.prepare(req.job, _read_opt(req.task_file))  # type: ignore[no-any-return]

    async def _train(self, req: msg.Train, rid: int) -> int:
        run = self._runs[rid] = _Run()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._report_progress, rid, run)
                try:
                    return int(await self.executor.train(req.eff, run.should_stop))
                except Exception as exc:  # out of the nursery as itself, not in a group
                    failed = exc
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self._runs.pop(rid, None)
        raise failed

    async def _pieces(self, req: msg.Pieces, _rid: int) -> dict[str, Any]:
        return dict(await self.executor.pieces(req.job, req.round, req.shards, req.inner_steps, req.first))

    async def _delta(self, req: msg.Delta, _rid: int) -> msg.DeltaFile:
        data, metrics = await self.executor.delta(req.eff)
        if req.rank > 0:  # its copy is the same as the first worker's: keep one
            return msg.DeltaFile(None, metrics)
        return msg.DeltaFile(write_work(req.out, data), metrics)

    # Deltas go as paths, read one at a time by the outer step; whoever wrote them removes them.

    async def _reduce_slice(self, req: msg.ReduceSlice, _rid: int) -> Path:
        data = await self.executor.reduce_slice(req.job, list(req.deltas), req.first, req.stop, rnd=req.round)
        return write_work(req.out, data)

    async def _aggregate(self, req: msg.Aggregate, _rid: int) -> msg.Aggregated:
        state, metrics = await self.executor.aggregate(req.job, req.base, list(req.deltas), rnd=req.round,
                                                       sliced=req.sliced, outer=req.outer)
        return msg.Aggregated(state, metrics)

    async def _apply(self, req: msg.Apply, _rid: int) -> bool:
        return bool(await self.executor.apply(req.job, req.base, list(req.deltas), req.expect, rnd=req.round,
                                              sliced=req.sliced, outer=req.outer))

    async def _export_state(self, req: msg.ExportState, _rid: int) -> None:
        await self.executor.export_state(req.job, req.state, req.out)  # file to file: no bytes held here

    async def _import_state(self, req: msg.ImportState, _rid: int) -> bool:
        try:
            return bool(await self.executor.import_state(req.job, req.state, req.file))
        finally:
            req.file.unlink(missing_ok=True)

    async def _finish(self, req: msg.Finish, _rid: int) -> None:
        await self.executor.finish(req.job, req.state, req.metrics)

    async def _report_progress(self, rid: int, run: _Run) -> None:
        sent = 0
        while True:
            await trio.sleep(PROGRESS_EVERY)
            if run.calls != sent:
                sent = run.calls
                await self.send({"id": rid, "progress": sent})


_HANDLERS: dict[type[Message[Any]], Callable[[_Worker, Any, int], Awaitable[Any]]] = {
    msg.Warm: _Worker._warm, msg.JoinGroup: _Worker._join_group, msg.Forget: _Worker._forget,
    msg.NewJob: _Worker._new_job, msg.Prepare: _Worker._prepare, msg.Train: _Worker._train,
    msg.Pieces: _Worker._pieces, msg.Delta: _Worker._delta, msg.ReduceSlice: _Worker._reduce_slice,
    msg.Aggregate: _Worker._aggregate, msg.Apply: _Worker._apply, msg.ExportState: _Worker._export_state,
    msg.ImportState: _Worker._import_state, msg.Finish: _Worker._finish,
}
# Calls that allocate model-sized memory: the worker's resident set is trimmed after each.
_LARGE = frozenset({msg.NewJob, msg.Prepare, msg.Train, msg.Delta, msg.ReduceSlice, msg.Aggregate, msg.Apply,
                    msg.ExportState, msg.ImportState, msg.Finish})


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


def _read_opt(path: Path | None) -> bytes | None:
    return path.read_bytes() if path else None


async def _serve(fd_in: int, fd_out: int) -> None:
    out = trio.lowlevel.FdStream(fd_out)
    reader = FrameReader(trio.lowlevel.FdStream(fd_in))
    worker = _Worker(out)
    import torch

    await worker.send(CODEC.encode(msg.Hello(os.getpid(), torch.__version__,
                                             torch.cuda.device_count() if torch.cuda.is_available() else 0)))
    first = await reader.read()
    if first is None:
        return
    config = _decoded(first)
    if not isinstance(config, msg.Configure):
        raise ChannelError(f"the daemon sent {config.op!r} before its configuration")
    from .._home import Home
    from ._torch import TorchExecutor

    worker.executor = TorchExecutor(Home(config.home), device=config.device, task_options=config.task_options,
                                    memory_limit=config.memory_limit)
    async with trio.open_nursery() as nursery:
        while (frame := await reader.read()) is not None:
            rid = frame.pop("id", None)
            if type(rid) is not int:
                raise ChannelError(f"a request without its id: {frame.get('op')!r}")
            try:
                request = CODEC.decode(frame)
                if not isinstance(request, msg.Cancel) and type(request) not in _HANDLERS:
                    raise MessageError(f"{request.op!r} is not a request")
            except MessageError as exc:
                await worker.send({"id": rid, **failure(exc)})
                continue
            if isinstance(request, msg.Cancel):
                worker.cancel(rid)
            else:
                nursery.start_soon(worker.handle, rid, request)
        # The daemon closed the channel (it stops, or gave up on this worker): leave now,
        # without waiting for a step in a torch thread. Every file that matters was
        # written atomically, so nothing is torn.
        os._exit(0)


def _decoded(frame: dict[str, Any]) -> Message[Any]:
    try:
        return CODEC.decode(frame)
    except MessageError as exc:
        raise ChannelError(f"not a message of this worker: {exc}") from None


if __name__ == "__main__":
    main()
