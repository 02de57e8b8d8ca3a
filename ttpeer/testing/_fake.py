"""A stand-in executor whose "models" are hashes, for the simulator.

A state is a hash; the outer step hashes the base with the contributions' delta
bytes in the order given (a sliced round: with its reduced slices, whose bytes are drawn
chunk by chunk from the contributions' bytes, in the real reduced-slice format, for jobs
of ``chunk`` = ``FAKE_CHUNK``), so two peers reach the same state exactly when they
apply the same contributions to the same base, which is what I3 is about. Training
takes simulated time (``step_time / speed`` per batch) under trio's MockClock and
honours cancellation between batches, like the real trainer; a task named in
``fails`` fails after its first batch, as broken task code would.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import zstandard

from ttpeer._chunked import HEAD, LENGTH, MAGIC, PLAIN_HEAD, PLAIN_MAGIC, chunk_span
from ttpeer.daemon import Deltas, delta_bytes
from ttpeer.errors import TaskFailed
from ttpeer.proto import JobSpec, Outer, PublishDelta, Train

FAKE_CHUNKS = 12  # chunks of a fake model's chunked delta (a sliced job): slices of several up to 6 peers
FAKE_CHUNK = 4096  # values a chunk (the job's ``chunk``)
FAKE_BLOCKS = 16  # quantization blocks a chunk


def _h(*parts: object) -> str:
    return "sha256:" + hashlib.sha256(repr(parts).encode()).hexdigest()


class Gate:
    """Open unless paused: a SIGSTOPped process, in the simulator."""

    def __init__(self) -> None:
        self._open = trio.Event()
        self._open.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self) -> None:
        if not self.paused:
            self._open = trio.Event()

    def resume(self) -> None:
        self._open.set()

    async def wait(self) -> None:
        await self._open.wait()


class GatedTransport:
    """A transport that stands still while its gate is paused, like a stopped process."""

    def __init__(self, inner: Any, gate: Gate) -> None:
        self._inner = inner
        self._gate = gate

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not inspect.iscoroutinefunction(attr):  # a value, or a plain method (describe)
            return attr

        async def gated(*args: Any, **kwargs: Any) -> Any:
            await self._gate.wait()
            result = await attr(*args, **kwargs)
            await self._gate.wait()  # a reply that arrives during the pause is read after it
            return result

        return gated


@dataclass
class FakeDisk:
    """What survives a crash of a simulated peer: held states and finished jobs."""

    states: dict[str, set[str]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)


class FakeExecutor:
    def __init__(
        self, name: str, disk: FakeDisk, *, speed: float = 1.0, step_time: float = 0.05, gate: Gate | None = None,
        fails: dict[str, str | Exception] | None = None, forge: bool = False, silent: bool = False,
    ) -> None:
        """``fails``: by task name, how training that task fails after its first batch: a
        reason (``TaskFailed``, as a real executor raises it) or an exception to raise as it
        is (a bug that escaped an executor)."""
        self.name = name
        self.forge = forge  # every slice this peer reduces comes out wrong (a faulty or hostile peer)
        self.silent = silent  # it never finishes reducing a slice (claims by turn, never publishes)
        self.reduced: list[tuple[str, int, int]] = []  # (job, round, first chunk) of each slice reduced here
        self.fails = fails if fails is not None else {}
        self.released: set[str] = set()  # jobs the node said ended here (release)
        self.failures = 0  # times a training of a failing task failed here
        self.disk = disk
        self.speed = speed
        self.step_time = step_time
        self.gate = gate or Gate()
        self.trained: list[tuple[str, int, int]] = []  # (job, round, shard) actually trained
        self.task_files: dict[str, bytes | None] = {}  # job -> the task file prepare was given
        self._local: dict[str, tuple[str, list[int]]] = {}  # job -> (base, shards in local model)
        self.on_missing = None  # its tasks read no dataset pieces

    async def pieces(self, job: JobSpec, rnd: int, shards: list[int], inner_steps: int,
                     first: int) -> dict[str, Any]:
        return {}

    async def new_job(self, spec: dict[str, Any], task_file: bytes | None) -> tuple[dict[str, Any], bytes]:
        init = _h("init", spec["task"], spec["seed"])
        return {"task_hash": hashlib.sha256(spec["task"].encode()).hexdigest(), "init": init}, init.encode()

    async def prepare(self, job: JobSpec, task_file: bytes | None) -> str | None:
        self.task_files[job.id] = task_file
        return None

    async def train(self, eff: Train, should_stop: Callable[[], bool]) -> int:
        done = 0
        for _ in range(eff.schedule()[0]):
            if should_stop():
                break
            await self.gate.wait()
            await trio.sleep(self.step_time / self.speed)
            done += 1
            failure = self.fails.get(eff.job.task)
            if failure is not None:
                self.failures += 1
                raise TaskFailed(failure) if isinstance(failure, str) else failure
        if done:
            base, shards = self._local.get(eff.job.id, (eff.base, []))
            if eff.fresh or base != eff.base:
                base, shards = eff.base, []
            self._local[eff.job.id] = (base, [*shards, eff.shard])
            self.trained.append((eff.job.id, eff.round, eff.shard))
        return done * eff.job.batch_size

    async def delta(self, eff: PublishDelta) -> tuple[bytes, dict[str, float]]:
        base, shards = self._local.get(eff.job.id, (eff.base, []))
        data, metrics = repr((self.name, base, sorted(shards))).encode(), {"fp32_bytes": 4000.0}
        if eff.job.chunk:  # the chunked layout, so it is sealed and fetched in pieces
            metrics["chunks"] = float(FAKE_CHUNKS)
            frames = [data + b"#%d" % c for c in range(FAKE_CHUNKS)]
            data = (HEAD.pack(MAGIC, 8, FAKE_CHUNK // FAKE_BLOCKS, FAKE_CHUNKS * FAKE_CHUNK, FAKE_CHUNK)
                    + b"".join(LENGTH.pack(len(f)) for f in frames) + b"".join(frames))
        return data, metrics

    async def reduce_slice(self, job: JobSpec, deltas: Deltas, first: int, stop: int, *, rnd: int) -> bytes:
        if self.silent:
            await trio.sleep_forever()
        self.reduced.append((job.id, rnd, first))
        raws = [(delta_bytes(ref), samples) for ref, samples in deltas]  # the head and this slice's chunks
        # A reduced slice in the real format (``TTD1``: block scales, then the values at the
        # job's ``slice_bits``, two to a byte below 8), each chunk's bytes drawn from that
        # chunk of every contribution: a spot check that reduces one chunk alone finds
        # that run of the whole (``_chunked.run_matches``). A forger's differ in every chunk.
        bits = job.slice_bits
        scales, values = [], []
        for c in range(first, stop):
            runs = [(raw[slice(*chunk_span(raw, c, c + 1))], samples) for raw, samples in raws]
            drawn = hashlib.shake_256(repr(("forged" if self.forge else "slice", c, runs)).encode())
            raw_chunk = drawn.digest(4 * FAKE_BLOCKS + (FAKE_CHUNK if bits == 8 else FAKE_CHUNK // 2))
            scales.append(raw_chunk[:4 * FAKE_BLOCKS])
            values.append(raw_chunk[4 * FAKE_BLOCKS:])
        payload = b"".join(scales) + b"".join(values)
        return (PLAIN_HEAD.pack(PLAIN_MAGIC, bits, FAKE_CHUNK // FAKE_BLOCKS, (stop - first) * FAKE_CHUNK)
                + zstandard.ZstdCompressor(write_content_size=True).compress(payload))

    def _outer(self, base: str, deltas: Deltas, sliced: bool = False, outer: Outer | None = None) -> str:
        # The outer step a close names is part of the result: peers that took another differ.
        step = [] if outer is None else [list(outer)]
        if sliced:  # the reduced slices, in order: the round's mean
            return _h(base, "mean", [delta_bytes(d) for d, _s in deltas], *step)
        return _h(base, [(delta_bytes(d), s) for d, s in deltas], *step)

    async def aggregate(self, job: JobSpec, base: str, deltas: Deltas, *, rnd: int,
                        sliced: bool = False, outer: Outer | None = None) -> tuple[str, dict[str, float]]:
        state = self._outer(base, deltas, sliced, outer)
        self.disk.states.setdefault(job.id, set()).add(state)
        return state, {"eval_loss": 1.0, "accuracy": 0.5}

    async def apply(self, job: JobSpec, base: str, deltas: Deltas, expect: str, *, rnd: int,
                    sliced: bool = False, outer: Outer | None = None) -> bool:
        if base not in self.disk.states.get(job.id, set()):
            return False
        state = self._outer(base, deltas, sliced, outer)
        if state != expect:
            return False
        self.disk.states.setdefault(job.id, set()).add(state)
        return True

    async def export_state(self, job: JobSpec, state: str, out: Path) -> None:
        out.write_bytes(state.encode())

    async def import_state(self, job: JobSpec, state: str, data: bytes | Path) -> bool:
        if isinstance(data, Path):
            data = data.read_bytes()
        if data != state.encode():
            return False
        self.disk.states.setdefault(job.id, set()).add(state)
        return True

    def held_states(self, job: str) -> set[str]:
        return set(self.disk.states.get(job, set()))

    async def release(self, job: str) -> None:
        self.released.add(job)

    async def finish(self, job: JobSpec, state: str, metrics: dict[str, Any]) -> None:
        self.disk.finished[job.id] = state
