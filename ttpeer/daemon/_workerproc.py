"""One worker process and its channel (``_Worker``), and what a group of them does
together: a call in every worker at once (``_all``), a load that ends them all when it
fails (``_loading``), their end (``_close_all``); how a worker's failure reads
(``_error``, ``describe_exit``). ``ProcessExecutor`` (``_procexec.py``) supervises them.

A worker this daemon ends itself (``kill(why)``: the job ended here, the daemon stops)
is said to have been stopped, with the reason, never to have died of a signal.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from ttpeer.errors import DiskError, JobError, StateMissing, TaskFailed
from ttpeer.proto import DatasetMissing

from ._channel import ChannelError, FrameReader, send

log = logging.getLogger("ttpeer.workers")
HELLO_TIMEOUT = 300.0  # importing torch on a cold, busy machine


class WorkerDied(Exception):
    """The worker process ended (or broke the channel) while calls were pending."""


@dataclass
class _Call:
    done: trio.Event = field(default_factory=trio.Event)
    reply: dict[str, Any] | None = None
    beat: float = 0.0  # trio time of the last sign of progress
    on_progress: Callable[[int], bool] | None = None  # True: the daemon wants it stopped
    cancelled: bool = False


class _Worker:
    """One worker process and its channel: calls go out, replies come back by id."""

    _ids = itertools.count(1)

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._reader = FrameReader(process.stdout)  # type: ignore[arg-type]
        self._send_lock = trio.Lock()
        self._pending: dict[int, _Call] = {}
        self.hello: dict[str, Any] = {}
        self.device = ""
        self.died: str | None = None
        self.stopped: str | None = None  # why this daemon ended it, when it did
        self.busy = 0
        self._outgoing, self._outgoing_recv = trio.open_memory_channel[dict[str, Any]](math.inf)

    @property
    def alive(self) -> bool:
        return self.died is None

    async def start(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Wait for the worker's hello, then read its frames until it ends."""
        try:
            with trio.fail_after(HELLO_TIMEOUT):
                first = await self._reader.read()
            if first is None or "hello" not in first:
                raise ChannelError("the worker ended before it was ready")
            self.hello = first["hello"]
        except (ChannelError, trio.TooSlowError, trio.BrokenResourceError) as exc:
            await self._ended(f"it did not start ({exc})")
            raise WorkerDied(self.died) from None
        task_status.started()
        try:
            while (msg := await self._reader.read()) is not None:
                self._on_frame(msg)
            await self._ended(None)
        except (ChannelError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            await self._ended(f"its channel broke ({exc})")

    def _on_frame(self, msg: dict[str, Any]) -> None:
        rid = msg.get("id", -1)
        call = self._pending.get(rid)
        if call is None:
            return
        if "progress" in msg:
            call.beat = trio.current_time()
            if call.on_progress is not None and call.on_progress(int(msg["progress"])) and not call.cancelled:
                call.cancelled = True
                self._nursery_send({"id": rid, "op": "cancel"})
            return
        call.reply = msg
        call.done.set()

    async def _ended(self, why: str | None) -> None:
        if self.died is not None:
            return
        with trio.CancelScope(shield=True):
            with trio.move_on_after(5):
                await self.process.wait()
            if self.process.returncode is None:
                self.process.kill()
                await self.process.wait()
        self.died = why or (f"this daemon stopped it: {self.stopped}" if self.stopped
                            else describe_exit(self.process.returncode))
        self._outgoing.close()
        for call in self._pending.values():
            call.done.set()

    async def send(self, obj: dict[str, Any]) -> None:
        async with self._send_lock:
            await send(self.process.stdin, obj)  # type: ignore[arg-type]

    async def call(self, op: str, args: dict[str, Any], *, timeout: float, step: bool = False,
                   on_progress: Callable[[int], bool] | None = None) -> Any:
        """Run ``op`` in the worker. ``timeout``: seconds without a reply (``step``: without
        progress either) before the worker is killed and ``TaskFailed`` raised."""
        if self.died is not None:
            raise WorkerDied(self.died)
        rid = next(self._ids)
        log.debug("worker %d: request %d %s", self.process.pid, rid, op)
        call = self._pending[rid] = _Call(beat=trio.current_time(), on_progress=on_progress)
        self.busy += 1
        try:
            try:
                await self.send({"id": rid, "op": op, "args": args})
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await call.done.wait()  # the reader is noting the death
            while not call.done.is_set():
                with trio.move_on_at(call.beat + timeout):
                    await call.done.wait()
                if not call.done.is_set() and trio.current_time() >= call.beat + timeout:
                    self.kill()
                    what = "a step" if step else f"the task's code ({op})"
                    raise TaskFailed(f"{what} took longer than {_seconds(timeout)} (the job's step timeout, "
                                     "submit --step-timeout): the worker was stopped")
        finally:
            self.busy -= 1
            self._pending.pop(rid, None)
        if call.reply is None:
            raise WorkerDied(self.died or "it ended")
        if "ok" in call.reply:
            return call.reply["ok"]
        raise _error(call.reply)

    def _nursery_send(self, obj: dict[str, Any]) -> None:
        """Send from the reader task without blocking it: a cancel waits for no one."""
        self._outgoing.send_nowait(obj)

    async def _sender(self) -> None:
        async for obj in self._outgoing_recv:
            try:
                await self.send(obj)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return

    def kill(self, why: str | None = None) -> None:
        """SIGKILL the worker; ``why``: this daemon's reason, what its death is then said to be."""
        if self.process.returncode is None:
            self.stopped = self.stopped or why
            self.process.kill()

    async def close(self) -> None:
        """End the worker: closing its channel is enough (it exits at once)."""
        with trio.CancelScope(shield=True):
            try:
                await self.process.stdin.aclose()  # type: ignore[union-attr]
            except trio.BrokenResourceError:
                pass
            with trio.move_on_after(5):
                await self.process.wait()
            self.kill()


def _error(reply: dict[str, Any]) -> Exception:
    kind, message = reply.get("error"), str(reply.get("message", ""))
    if kind in ("task", "oom"):
        return TaskFailed(message)
    if kind == "state_missing":
        return StateMissing(str(reply.get("state", "")))
    if kind == "disk":
        return DiskError(Path(str(reply.get("path") or "the ttpeer home")), OSError(28, message))
    if kind == "dataset":
        pieces = reply.get("pieces")
        missing = DatasetMissing(str(reply.get("name", "")), dataset=str(reply.get("dataset") or ""),
                                 pieces=[p for p in pieces if type(p) is int] if isinstance(pieces, list) else None,
                                 whole=reply.get("whole") is not False)
        missing.moved = reply.get("moved") is True
        return missing
    return JobError(message)


def describe_exit(code: int | None) -> str:
    """How a worker ended, for people: the signal's name, or the exit code."""
    if code is None:
        return "it stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the kernel's out-of-memory killer sends SIGKILL when memory runs out)" if -code == 9 else ""
        return f"it was killed by {name}{hint}"
    return f"it exited with code {code}"


def _seconds(t: float) -> str:
    return f"{t / 60:g} min" if t >= 60 and t % 60 == 0 else f"{t:g} s"


async def _all(group: list[_Worker], request: Callable[[int], tuple[str, dict[str, Any]]], *, timeout: float,
               step: bool = False, on_progress: Callable[[int], bool] | None = None) -> list[Any]:
    """Run one call in every worker of a group at once (they meet in collectives, so
    one at a time would wait forever); results by rank. The first failure cancels the
    rest, whose workers the caller then ends."""
    results: list[Any] = [None] * len(group)

    async def one(rank: int) -> None:
        op, args = request(rank)
        results[rank] = await group[rank].call(op, args, timeout=timeout, step=step,
                                               on_progress=on_progress if rank == 0 else None)

    try:
        async with trio.open_nursery() as nursery:
            for rank in range(len(group)):
                nursery.start_soon(one, rank)
    except BaseExceptionGroup as eg:
        for kind in (TaskFailed, WorkerDied, DatasetMissing):  # the most telling failure first
            match, _rest = eg.split(kind)
            if match is not None:
                first: BaseException = match
                while isinstance(first, BaseExceptionGroup):
                    first = first.exceptions[0]
                raise first from None
        raise
    return results


@contextlib.asynccontextmanager
async def _loading(group: list[_Worker], keep: tuple[type[BaseException], ...] = ()) -> AsyncIterator[None]:
    """Starting or preparing ``group``: any failure but ``keep`` ends its workers, and a
    worker's death while the task loads fails the job here."""
    try:
        yield
    except keep:
        raise
    except WorkerDied as exc:
        await _close_all(group)
        raise TaskFailed(f"the worker process died while loading the task ({exc})") from None
    except BaseException:
        await _close_all(group)
        raise


async def _close_all(group: list[_Worker], why: str | None = None) -> None:
    for w in group:
        w.kill(why)
    for w in group:
        await w.close()
