"""Mailboxes: small sealed messages waiting for one peer of one pool.

Theory of operation. Each (pool, peer) has a queue of ``(seq, sender, data)``
held in memory only. Seqs strictly increase and are never reused, even across
restarts: a new mailbox starts at the wall clock in microseconds, which is past
every seq an earlier mailbox could have reached (that would take more than one
message per microsecond). A receiver acknowledges by cursor: asking for
messages after N deletes every message up to N, so delivery is at-least-once and
a receiver that crashed before acting simply asks again with its old cursor.

Memory is bounded three ways: messages per mailbox, bytes per mailbox, and bytes
across all mailboxes (each message also counts a fixed overhead). Empty
mailboxes that nobody waits on are forgotten after a while.

A long-poll waits on the mailbox's ``trio.Event``; every put sets it and installs
a fresh one, so waiting costs nothing and wakes at once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

MESSAGE_OVERHEAD = 64  # bytes charged per message on top of its payload


@dataclass(frozen=True, slots=True)
class Stored:
    seq: int
    sender: str
    data: bytes


class MailboxFull(Exception):
    """A put would exceed a mailbox cap; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _Mailbox:
    def __init__(self, first_seq: int, now: float) -> None:
        self.messages: deque[Stored] = deque()
        self.next_seq = first_seq
        self.bytes = 0
        self.waiters = 0
        self.touched = now
        self.changed = trio.Event()

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


def _wall_micros() -> int:
    return time.time_ns() // 1000


class Mailboxes:
    def __init__(
        self,
        *,
        max_messages: int = 4096,
        max_bytes: int = 64 * 2**20,
        max_total_bytes: int = 2**30,
        retry_after: float = 5.0,
        first_seq: Callable[[], int] = _wall_micros,
    ) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.max_total_bytes = max_total_bytes
        self.retry_after = retry_after
        self.total_bytes = 0
        self._first_seq = first_seq
        self._boxes: dict[tuple[str, str], _Mailbox] = {}
        self._closed = False

    def _box(self, pool: str, peer: str, now: float) -> _Mailbox:
        box = self._boxes.get((pool, peer))
        if box is None:
            box = self._boxes[(pool, peer)] = _Mailbox(self._first_seq(), now)
        box.touched = now
        return box

    def put(self, pool: str, peer: str, sender: str, data: bytes, now: float) -> int:
        """Queue ``data`` for ``peer``; returns its seq. Raises ``MailboxFull``."""
        cost = len(data) + MESSAGE_OVERHEAD
        box = self._box(pool, peer, now)
        if len(box.messages) >= self.max_messages or box.bytes + cost > self.max_bytes:
            raise MailboxFull(
                f"mailbox of peer {peer[:16]}... is full ({len(box.messages)} messages, "
                f"{box.bytes} bytes); the peer is not collecting its messages",
                self.retry_after,
            )
        if self.total_bytes + cost > self.max_total_bytes:
            raise MailboxFull("the relay's mailbox memory is full", self.retry_after)
        seq = box.next_seq
        box.next_seq += 1
        box.messages.append(Stored(seq, sender, data))
        box.bytes += cost
        self.total_bytes += cost
        box.wake()
        return seq

    def _ack(self, box: _Mailbox, after: int) -> None:
        while box.messages and box.messages[0].seq <= after:
            cost = len(box.messages.popleft().data) + MESSAGE_OVERHEAD
            box.bytes -= cost
            self.total_bytes -= cost

    @staticmethod
    def _pending(box: _Mailbox, max_count: int, max_bytes: int) -> list[Stored]:
        out: list[Stored] = []
        size = 0
        for msg in box.messages:
            if out and (len(out) >= max_count or size + len(msg.data) > max_bytes):
                break
            out.append(msg)
            size += len(msg.data)
        return out

    async def receive(
        self, pool: str, peer: str, after: int, wait: float, *, max_count: int, max_bytes: int
    ) -> list[Stored]:
        """Acknowledge everything up to ``after``, then return what follows.

        Waits up to ``wait`` seconds for a first message; returns early (maybe
        empty) when the relay shuts down.
        """
        box = self._box(pool, peer, trio.current_time())
        self._ack(box, after)
        box.waiters += 1
        try:
            with trio.move_on_after(wait):
                while not box.messages and not self._closed:
                    await box.changed.wait()
        finally:
            box.waiters -= 1
            box.touched = trio.current_time()
        return self._pending(box, max_count, max_bytes)

    def collect(self, now: float, idle: float) -> None:
        """Forget empty mailboxes nobody has touched for ``idle`` seconds."""
        for key, box in list(self._boxes.items()):
            if not box.messages and not box.waiters and now - box.touched > idle:
                del self._boxes[key]

    def close(self) -> None:
        """Wake every long-poll: the relay is shutting down."""
        self._closed = True
        for box in self._boxes.values():
            box.wake()
