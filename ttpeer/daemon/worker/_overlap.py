"""Where an overlapped round's local work starts, and how it is corrected mid-round.

Theory of operation. With overlap, round r trains while round r-1's deltas travel and its
close is made: the protocol hands the shard round r-1's base (``Train.base``), and the close
of round r will apply the round's deltas to round r's base, which does not exist yet. The
local model therefore starts from this peer's *estimate* of round r's base: round r-1's
outer step taken with its own delta of round r-1 for the pool's mean ("eager updates",
Kale et al. 2025). The estimate is right in the direction every peer moved and wrong by
this peer's own share of the noise, amplified by the outer step.

As soon as the close of round r-1 lands here (this peer aggregated it or applied it, in
the close thread), the real base is known; at its next batch boundary the training thread
moves the local model by (real base - estimate), keeping the progress made since the
start, and the round's delta is measured from the real base from then on. Only the steps
trained before the close landed were taken from the estimate; a close that lands before
the round starts (``Train.ahead``) means no estimate at all, and one that lands after the
shard ended changes nothing (the delta against the estimate is the same vector).

Local only: the close applies the pool's mean to the real base whatever each peer started
from, so every peer's states stay bit-identical (I3). What breaks it: nothing the pool
shares; a correction onto a close that later loses a fork only moves this peer's local
model, like any estimate.

Thread use: ``landed`` runs in the close thread, ``take`` and ``corrected`` in the
training thread; one lock guards the hand-over.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ttpeer import train
from ttpeer.proto import Outer


@dataclass
class Start:
    """Where the local model of ``round`` (trained on ``base``) started: the held state
    ``state`` (the round's own base, or ``base`` itself), or ``estimate`` (params and
    momentum, in memory) until a correction moves it onto a held state."""

    round: int
    base: str
    estimate: train.OuterState | None = None
    state: str | None = None


class EagerStart:
    """One overlapped fused job's starts on this peer."""

    def __init__(self) -> None:
        self.start: Start | None = None
        # This peer's latest published pseudo-gradient, unquantized, as (round, delta).
        self.own: tuple[int, dict[str, torch.Tensor]] | None = None
        # The outer step of the last close made here: the next estimate's.
        self.outer: Outer | None = None
        # The newest close made here, as (the round it is the base of, that round's Train
        # base, its state); and whether the shard in training has been moved onto it.
        self._landed: tuple[int, str, str] | None = None
        self._moved = True
        self._lock = threading.Lock()

    def begin(self, rnd: int, base: str, *, estimate: train.OuterState | None = None,
              state: str | None = None) -> None:
        """A fresh shard of ``rnd`` on ``base`` started from ``estimate`` or held ``state``."""
        with self._lock:
            self.start = Start(rnd, base, estimate, state)
            self._moved = estimate is None

    def known(self, rnd: int, base: str) -> str | None:
        """The base of round ``rnd`` (trained on ``base``), if its close was made here."""
        got = self._landed
        return got[2] if got is not None and got[:2] == (rnd, base) else None

    def same_round(self, rnd: int, base: str) -> Start | None:
        """The start of round ``rnd`` on ``base``, if this peer began one."""
        s = self.start
        return s if s is not None and (s.round, s.base) == (rnd, base) else None

    def landed(self, rnd: int, base: str, state: str, step: Outer) -> None:
        """The close of round ``rnd`` on ``base`` made ``state`` here (close thread): if the
        shard in training is round ``rnd + 1`` started from an estimate of that state, it
        moves onto it at its next batch. ``step``: the close's outer step."""
        with self._lock:
            self.outer = step
            self._landed = (rnd + 1, base, state)

    def take(self) -> str | None:
        """The state the shard in training is to move onto, once its close has landed and
        until it has moved (``corrected``) (training thread)."""
        with self._lock:
            s = self.start
            if self._moved or s is None or s.estimate is None:
                return None
            return self.known(s.round, s.base)

    def estimate(self) -> train.OuterState | None:
        """The estimate the shard in training started from, while it has not been moved."""
        s = self.start
        return s.estimate if s is not None else None

    def corrected(self, state: str) -> None:
        """The local model now measures its progress from ``state``; the estimate is dropped."""
        with self._lock:
            self._moved = True
            if self.start is not None:
                self.start = Start(self.start.round, self.start.base, None, state)


def estimate(like: train.OuterState, base: Iterable[tuple[str, torch.Tensor, torch.Tensor]],
             own: dict[str, torch.Tensor], step: Outer) -> train.OuterState:
    """Round ``rnd + 1``'s base as this peer can guess it before round ``rnd``'s close:
    round ``rnd``'s base (``base``: its ``(name, param, momentum)`` one at a time, as
    ``train.iter_state_file`` reads them; ``like``: its template) after the outer ``step``
    with ``own`` for the mean. Its params only (``momentum`` is the same dicts): an
    estimate is where the local model starts and its delta is measured from, and its
    momentum is never read; nor is the base ever whole in memory."""
    total = train.OuterSum(like, [1])
    total.add(own)
    return total.step(lr=step.lr, momentum=step.momentum, nesterov=True, base=base, params_only=True)


Agree = Callable[[bool, "str | None"], "tuple[bool, str | None]"]


def correcting(trainer: train.InnerTrainer, starts: EagerStart,
               params: Callable[[str], Iterable[tuple[str, torch.Tensor]]],
               should_stop: Callable[[], bool], agree: Agree | None = None) -> Callable[[], bool]:
    """``should_stop`` for ``train_shard`` that also moves the local model onto a close
    that landed since the last batch (``params(state)``: that state's params, one tensor at
    a time). ``agree``: a peer's workers decide together (``train.agreed``): the stop flag
    and the landed state of the worker that closes reach every worker at the same batch,
    so their copies of the local model stay identical."""

    def ask() -> bool:
        stop, state = should_stop(), starts.take()
        if agree is not None:
            stop, state = agree(stop, state)
        start = starts.estimate()
        if state is not None and start is not None and not stop:
            trainer.shift(params(state), start.params)
            starts.corrected(state)
        return stop

    return ask
