"""One worker process and its channel (``_Worker``), and what a group of them does
together: a call in every worker at once (``_all``), a load that ends them all when it
fails (``_loading``), their end (``_close_all``); how a worker's end reads
(``describe_exit``). What a failed call raises is ``_failures``' table's.
``ProcessExecutor`` (``_procexec.py``) supervises them.

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
from typing import Any, TypeVar

import trio

from ttpeer.errors import DiskError, JobError, TaskFailed, TtpeerError
from ttpeer.proto import DatasetMissing

from .._codec import Message, MessageError
from . import _workermsg as msg
from ._channel import ChannelError, FrameReader, send
from ._failures import error
from ._workermsg import CODEC

log = logging.getLogger("ttpeer.workers")
HELLO_TIMEOUT = 300.0  # importing torch on a cold, busy machine
R = TypeVar("R")


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
        self.hello = msg.Hello(0, "", 0)
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
            if first is None:
                raise ChannelError("the worker ended before it was ready")
            hello = CODEC.decode(first)
            if not isinstance(hello, msg.Hello):
                raise ChannelError(f"the worker said {hello.op!r} before hello")
            self.hello = hello
        except (ChannelError, MessageError, trio.TooSlowError, trio.BrokenResourceError) as exc:
            await self._ended(f"it did not start ({exc})")
            raise WorkerDied(self.died) from None
        task_status.started()
        try:
            while (frame := await self._reader.read()) is not None:
                self._on_frame(frame)
            await self._ended(None)
        except (ChannelError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            await self._ended(f"its channel broke ({exc})")

    def _on_frame(self, frame: dict[str, Any]) -> None:
        rid = frame.get("id", -1)
        if type(rid) is not int:
            raise ChannelError(f"a frame whose id is not a number: {str(rid)[:40]}")
        call = self._pending.get(rid)
        if call is None:
            return
        if "progress" in frame:
            if type(frame["progress"]) is not int:
                raise ChannelError(f"a progress frame without a count: {frame['progress']!r}")
            call.beat = trio.current_time()
            if call.on_progress is not None and call.on_progress(frame["progress"]) and not call.cancelled:
                call.cancelled = True
                self._nursery_send({"id": frame["id"], **CODEC.encode(msg.Cancel())})
            return
        call.reply = frame
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

    async def configure(self, config: msg.Configure) -> None:
        await self.send(CODEC.encode(config))

    async def call(self, request: Message[R], *, timeout: float, step: bool = False,
                   on_progress: Callable[[int], bool] | None = None) -> R:
        """Run ``request`` in the worker. ``timeout``: seconds without a reply (``step``:
        without progress either) before the worker is killed and ``TaskFailed`` raised.
        A failure raises what the worker raised (``_failures``)."""
        if self.died is not None:
            raise WorkerDied(self.died)
        rid = next(self._ids)
        log.debug("worker %d: request %d %s", self.process.pid, rid, request.op)
        call = self._pending[rid] = _Call(beat=trio.current_time(), on_progress=on_progress)
        self.busy += 1
        try:
            try:
                await self.send({"id": rid, **CODEC.encode(request)})
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await call.done.wait()  # the reader is noting the death
            while not call.done.is_set():
                with trio.move_on_at(call.beat + timeout):
                    await call.done.wait()
                if not call.done.is_set() and trio.current_time() >= call.beat + timeout:
                    self.kill()
                    what = "a step" if step else f"the task's code ({request.op})"
                    raise TaskFailed(f"{what} took longer than {_seconds(timeout)} (the job's step timeout, "
                                     "submit --step-timeout): the worker was stopped")
        finally:
            self.busy -= 1
            self._pending.pop(rid, None)
        if call.reply is None:
            raise WorkerDied(self.died or "it ended")
        if "ok" not in call.reply:
            raise error(call.reply)
        try:
            return CODEC.reply(request, call.reply["ok"])
        except MessageError as exc:
            raise JobError(f"the worker's reply is malformed: {exc}") from None

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


async def _all(group: list[_Worker], request: Callable[[int], Message[R]], *, timeout: float,
               step: bool = False, on_progress: Callable[[int], bool] | None = None) -> list[R]:
    """Run one call in every worker of a group at once (they meet in collectives, so
    one at a time would wait forever); results by rank. The first failure cancels the
    rest, whose workers the caller then ends."""
    results: dict[int, R] = {}

    async def one(rank: int) -> None:
        results[rank] = await group[rank].call(request(rank), timeout=timeout, step=step,
                                               on_progress=on_progress if rank == 0 else None)

    try:
        async with trio.open_nursery() as nursery:
            for rank in range(len(group)):
                nursery.start_soon(one, rank)
    except BaseExceptionGroup as eg:
        # The most telling failure first (a full disk stops the daemon). A lone worker's other
        # ttpeer errors come out as themselves, for the protocol to retry; in a group of
        # several, the others may still wait in a collective for the one that failed, so such
        # a call is not retried behind them: the group's failure ends the job here.
        lone = (TtpeerError,) if len(group) == 1 else ()
        for kind in (DiskError, TaskFailed, WorkerDied, DatasetMissing, *lone):
            match, _rest = eg.split(kind)
            if match is not None:
                first: BaseException = match
                while isinstance(first, BaseExceptionGroup):
                    first = first.exceptions[0]
                raise first from None
        raise
    return [results[rank] for rank in range(len(group))]


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
