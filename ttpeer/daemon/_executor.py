"""What the daemon needs from the training side, as one narrow interface.

``Node`` drives ``PeerMachine`` effects through an ``Executor``: the real one
(``TorchExecutor``) runs torch in worker threads; the simulator's
(``ttpeer.testing.FakeExecutor``) stands in with hashes so dozens of peers run in
seconds. Blob transfer and sealing stay in the node: executors see plaintext
bytes only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ttpeer.proto import DatasetMissing, JobSpec, Outer, PublishDelta, Train

# A contribution's encoded delta: its bytes, or the path of a file that holds them. The
# node hands over files (fetched a bounded few at a time) so that neither it nor the worker
# holds every contribution of a round at once; an executor reads each file when it gets
# to it (``delta_bytes``) and leaves it in place: whoever wrote it removes it.
DeltaRef = bytes | Path


def delta_bytes(ref: DeltaRef) -> bytes:
    return ref if isinstance(ref, bytes) else ref.read_bytes()


Deltas = list[tuple[DeltaRef, int]]  # a round's contributions: (delta, samples trained)


@dataclass(frozen=True)
class Decline:
    """Why a peer sits a job out; ``need`` and ``have`` (bytes) when the model does not fit.
    ``code`` says what kind of reason it is, for machines (``DECLINE_CODES`` in
    ``ttpeer.proto``): "fit", "task" (the task file differs), "data" (its data differs)."""

    reason: str
    need: int = 0
    have: int = 0
    code: str = ""


class Executor(Protocol):
    # Called with a job and the ``DatasetMissing`` of pieces a task read that are not here
    # (set by the node): the node fetches them and the call is made again. An executor
    # whose tasks never wait on pieces leaves it unused.
    on_missing: Callable[[JobSpec, DatasetMissing], Awaitable[None]] | None

    async def new_job(self, spec: dict[str, Any], task_file: bytes | None) -> tuple[dict[str, Any], bytes | Path]:
        """Build a job's initial state for submission. Returns the job fields this side
        fixes (``task_hash``, ``init``, ``data``: a fingerprint of the task's data) and the
        initial state's bytes (or a file holding them, which the caller removes), after
        running the task on one batch. A warm start comes as ``spec["init"]``, the path of
        a safetensors file on this machine; the returned ``init`` (the state's hash)
        replaces it in the record. Raises ``TaskFailed`` for a task that does not load or
        fails on that batch, ``TtpeerError`` for a file that does not match its model or
        job fields no peer could train (a warm-up as long as the job)."""
        ...

    async def prepare(self, job: JobSpec, task_file: bytes | None) -> Decline | str | None:
        """Load the job's task and check it fits. Returns None when ready, else why this
        peer declines (a ``Decline`` with the memory figures, or just the reason).

        Every method that runs the task's code raises ``TaskFailed`` (task code or torch
        failed: the job ends on this peer), ``DiskError`` (stops the daemon), or another
        ``TtpeerError`` (this step failed; the protocol tries again), and nothing else."""
        ...

    async def train(self, eff: Train, should_stop: Callable[[], bool]) -> int:
        """Train one shard; returns the samples trained (0 if stopped before any)."""
        ...

    async def delta(self, eff: PublishDelta) -> tuple[bytes, dict[str, float]]:
        """The encoded local delta against ``eff.base`` and metrics (``fp32_bytes``,
        ``train_loss``; a sliced job's chunked delta: ``chunks``, its chunk count)."""
        ...

    async def reduce_slice(self, job: JobSpec, deltas: Deltas, first: int, stop: int, *, rnd: int) -> bytes:
        """A sliced job's (``chunk``) reduced slice of round ``rnd``: the sample-weighted
        mean of chunks ``first`` .. ``stop``-1 of the chunked deltas, in the given order,
        re-quantized to the job's ``slice_bits`` (``train.encode_slice``). The same inputs
        give the same bytes on every peer. Raises ``JobError`` for deltas that are not
        chunked alike."""
        ...

    async def aggregate(
        self, job: JobSpec, base: str, deltas: Deltas, *, rnd: int, sliced: bool = False, outer: Outer | None = None
    ) -> tuple[str, dict[str, float]]:
        """Apply the outer step of round ``rnd`` to ``base`` with the decoded deltas (in the
        given order, each ``(DeltaRef, samples)``; read one at a time); hold the result.
        ``outer``: the round's outer lr and momentum (a job with ``outer_auto``), else the
        job's (its outer lr: the job's outer schedule there). ``sliced``: ``deltas`` are the
        round's reduced slices in order, which together are the mean. Returns its state
        hash and eval metrics."""
        ...

    async def apply(self, job: JobSpec, base: str, deltas: Deltas, expect: str, *, rnd: int,
                    sliced: bool = False, outer: Outer | None = None) -> bool:
        """Like ``aggregate``, but keep the result only if it hashes to ``expect``."""
        ...

    async def export_state(self, job: JobSpec, state: str, out: Path) -> None:
        """Write a held state's bytes to the file ``out``, for a checkpoint blob (a file:
        a model-sized state is never one ``bytes`` in the daemon)."""
        ...

    async def import_state(self, job: JobSpec, state: str, data: bytes | Path) -> bool:
        """Hold the state in ``data`` (its bytes, or a file holding them) if it hashes to
        ``state``. A file stays where it is: the caller removes it."""
        ...

    def held_states(self, job: str) -> set[str]:
        """States held (in memory or on disk) for the job of id ``job``."""
        ...

    async def finish(self, job: JobSpec, state: str, metrics: dict[str, Any]) -> None:
        """The job is done and ``state`` is final: make it durable for ``ttpeer export``."""
        ...

    async def release(self, job: str) -> None:
        """The job ended on this peer (failed, cancelled, failed for the pool): free what
        holds it in memory (its model, its worker processes). Its files stay."""
        ...

    async def pieces(self, job: JobSpec, rnd: int, shards: list[int], inner_steps: int,
                     first: int) -> dict[str, Any]:
        """What shards ``shards`` of round ``rnd`` read of a ``dataset_samples`` job's
        dataset (``TorchExecutor.pieces``); empty when its data is not read by pieces."""
        ...
