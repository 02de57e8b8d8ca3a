"""A fused job on this peer: one model, trained locally from the round's base and
averaged by the outer step (DiLoCo).

A shard loads the round's base into the local model (or, with overlap, this peer's
estimate of it: ``_overlap.py``), runs AdamW over its batches, and publishes
``start - local`` quantized with error feedback (the residual stays here). A round's
close streams the base from its file through the outer step with the contributions
added one at a time (``train.OuterSum``), so host memory is bounded by the model, not
by the round; the new state is held before the evaluation model is built.

Several workers of one peer (``world > 1``) train each shard together, each on its part
of every batch, and agree on when to stop and when to move onto a landed close.

Every method runs in a worker thread; the executor's locks order them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ttpeer import train
from ttpeer.errors import JobError
from ttpeer.proto import JobSpec, Outer, PublishDelta, Train, slice_chunks
from ttpeer.train import LoadedTask, OuterState, OuterSum

from .._executor import Deltas, delta_bytes
from ._jobstates import JobStates
from ._overlap import EagerStart, correcting, estimate
from ._torchutil import need_pieces, values_of

log = logging.getLogger("ttpeer.train")


class Fused:
    """One fused job's local work on this peer: worker ``rank`` of ``world`` on ``device``."""

    delta_locked = True  # the delta reads the local model, which a shard in training moves

    def __init__(self, job: JobSpec, task: LoadedTask, trainer: train.InnerTrainer, states: JobStates, *,
                 device: str, rank: int = 0, world: int = 1) -> None:
        self.job, self.task, self.trainer, self.states = job, task, trainer, states
        self.device, self.rank, self.world = device, rank, world
        self.residual: dict[str, Any] | None = None  # error feedback of the quantized deltas
        # Overlapped jobs: where each round's local work started, and its corrections.
        self.overlap = EagerStart()
        self.mean_sq = 0.0  # the energy of the mean the last measured outer step applied (``outer``)

    # -- training ---------------------------------------------------------------------------

    def train(self, eff: Train, should_stop: Callable[[], bool]) -> int:
        """Train shard ``eff.shard`` of ``eff.round``; returns the samples of its batches
        completed. Raises ``train.DatasetMissing`` (``moved`` when steps were taken)."""
        try:
            need_pieces(self.task, self.shard_pieces(eff.round, eff.shard, *eff.schedule()), self.world, self.device)
            try:
                return self._steps(eff, should_stop)
            except train.DatasetMissing as exc:
                # Read after steps were taken (a dataset_samples wrapped in another Dataset,
                # whose pieces ttpeer cannot see ahead): fetched, then the shard trains again
                # from its round's base, as after a lost worker.
                exc.moved = True
                raise
        finally:
            # The gradients are not needed until the next shard's first step, which sets
            # them anew: freed here, the delta and the round's close do not sit beside them.
            self.trainer.optimizer.zero_grad(set_to_none=True)

    def _steps(self, eff: Train, should_stop: Callable[[], bool]) -> int:
        job, trainer = self.job, self.trainer
        if eff.fresh:
            self._start(eff)
        steps, first = eff.schedule()
        batches = train.shard_batches(self.task, job.seed, eff.round, eff.shard, job.shards, steps,
                                      job.batch_size, first_step=first)
        stop = should_stop
        if job.overlap:
            agree = train.agreed_signal(self.device) if self.world > 1 else None
            stop = correcting(trainer, self.overlap, self.states.params, should_stop, agree)
        elif self.world > 1:
            stop = train.agreed_stop(should_stop, self.device)
        if self.world == 1:
            return trainer.train_shard(batches, stop, first)
        parts = train.split_batches(batches, self.rank, self.world)
        mine = trainer.train_shard(parts, stop, first)
        # The peer trained whole batches (every worker its part): count them whole.
        done, total = 0, 0
        while done < len(parts) and total < mine:
            total += len(parts[done])
            done += 1
        return sum(len(b) for b in batches[:done])

    def _start(self, eff: Train) -> None:
        """Load the local model for a fresh shard: the round's base, or with overlap
        (``_overlap.py``) the round's own base once held here (``eff.ahead``), else this
        peer's estimate of it made with its own delta of the round before. A second shard
        of the same round (a backup after publishing, when ``own`` is already this round's)
        starts where the first did; a peer with no delta of the round before (it trained
        none, or restarted) starts from the base."""
        ov = self.overlap
        if self.job.overlap:
            ahead = eff.ahead or ov.known(eff.round, eff.base)  # made here before the machine saw it
            if ahead is not None and ahead in self.states.held():
                return self._start_from(eff, ahead)
            began = ov.same_round(eff.round, eff.base)
            if began is not None:
                if began.estimate is not None:
                    return self._start_from(eff, None, began.estimate)
                return self._start_from(eff, began.state or eff.base)
            own = ov.own
            if own is not None and own[0] == eff.round - 1:
                guess = estimate(self.states.like, self.states.stream(eff.base), own[1],
                                 ov.outer or job_outer(self.job, eff.round - 1))
                return self._start_from(eff, None, guess)
        self._start_from(eff, eff.base)

    def _start_from(self, eff: Train, state: str | None, guess: OuterState | None = None) -> None:
        """Load held ``state``'s params (read from its file) or ``guess`` into the local model."""
        if guess is not None:
            self.trainer.start(guess)
        else:
            assert state is not None
            params = dict(self.states.params(state))
            self.trainer.start(OuterState(params=params, momentum=params))
        if self.job.overlap:
            self.overlap.begin(eff.round, eff.base, estimate=guess, state=state)

    def shard_pieces(self, rnd: int, shard: int, inner_steps: int, first: int) -> list[int]:
        """The pieces of a ``dataset_samples`` training set that shard ``shard`` of ``rnd`` reads."""
        if not isinstance(self.task.train, train.Samples):
            return []
        batches = train.shard_batches(self.task, self.job.seed, rnd, shard, self.job.shards, inner_steps,
                                      self.job.batch_size, first_step=first)
        return self.task.train.pieces_for(i for b in batches for i in b)

    def pieces(self, rnd: int, shards: list[int], inner_steps: int, first: int) -> dict[str, Any]:
        """See ``TorchExecutor.pieces``: a hint, so a failure to work it out is logged, not raised."""
        train_set = self.task.train
        if not isinstance(train_set, train.Samples):
            return {}
        try:
            per = {s: self.shard_pieces(rnd, s, inner_steps, first) for s in shards}
            test = self.task.test
            # The test set, when it is a part of the same dataset (``split``): every close reads it.
            same = test if isinstance(test, train.Samples) and test.index.dataset == train_set.index.dataset else None
            return {"dataset": train_set.index.dataset, "name": train_set.index.name,
                    "pieces": {str(s): p for s, p in per.items()},
                    "missing": {str(s): train_set.missing(p) for s, p in per.items()},
                    "test": train_set.missing(same.pieces_for(range(len(same)))) if same is not None else []}
        except Exception as exc:  # noqa: BLE001 - only a hint: its failure must not fail the job
            log.warning("job %s: could not work out the pieces of round %d: %s", self.job.id[:12], rnd, exc)
            return {}

    # -- publishing and closing ---------------------------------------------------------------

    def delta(self, eff: PublishDelta) -> tuple[bytes, dict[str, float]]:
        """The round's pseudo-gradient from where the local model started (or was moved
        onto), quantized with this peer's residual, and the figures that go with it."""
        began = self.overlap.same_round(eff.round, eff.base)
        if began is not None and began.estimate is not None:
            delta = self.trainer.delta(began.estimate)
        else:  # from the held state it started from (or was moved onto), else the base
            held = began.state if began is not None and began.state is not None else eff.base
            delta = self.trainer.delta_from(self.states.params(held))
        self.overlap.own = (eff.round, delta) if self.job.overlap else None
        data, self.residual = train.encode_delta(delta, self.residual, bits=self.job.bits, chunk=self.job.chunk)
        metrics = {"fp32_bytes": float(train.fp32_size(delta)), **self.trainer.recipe.metrics(self.job.batch_size)}
        if self.job.outer_agree:  # the pool's outer step weighs it (``proto.agreement``)
            energy = train.energy(delta)
            if math.isfinite(energy) and energy > 0:
                metrics["delta_sq"] = float(f"{energy:.6g}")
        if self.job.chunk is not None:
            metrics["chunks"] = float(-(-values_of(self.states.like) // self.job.chunk))
        loss = self.trainer.take_train_loss()
        if loss is not None and math.isfinite(loss):  # a record holds finite numbers only
            metrics["train_loss"] = round(loss, 6)
        return data, metrics

    def outer(self, base: str, deltas: Deltas, sliced: bool, step: Outer, *, measure: bool = False) -> OuterState:
        """The outer ``step`` on ``base`` with the round's mean (``mean``), the base read from
        its file one tensor at a time (never whole in memory beside the sum and the new state).
        ``measure`` (the closer of a job with ``outer_agree``): ``mean_sq`` is then the energy
        of that mean; otherwise 0 (a peer that applies a close needs no figure of it)."""
        total = self.mean(deltas, sliced)
        new = total.step(lr=step.lr, momentum=step.momentum, nesterov=True, base=self.states.stream(base),
                         measure=measure)
        self.mean_sq = total.mean_sq
        return new

    def mean(self, deltas: Deltas, sliced: bool) -> OuterSum:
        """The round's mean: one contribution at a time, tensor by tensor, into the running
        sum. ``sliced``: the contributions are the reduced slices of the mean, in order."""
        like = self.states.like
        if sliced:
            numel, chunk = values_of(like), self.job.chunk
            assert chunk is not None  # only a sliced job's rounds reduce in slices
            spans = slice_chunks(-(-numel // chunk), len(deltas))
            if len(spans) != len(deltas):
                raise JobError(f"{len(deltas)} slices for a model of {-(-numel // chunk)} chunks")
            means = (train.decode_slice(delta_bytes(ref), min(stop * chunk, numel) - first * chunk)
                     for (ref, _samples), (first, stop) in zip(deltas, spans, strict=True))
            return train.mean_sum(like, means)
        total = train.OuterSum(like, [samples for _ref, samples in deltas])
        for ref, _samples in deltas:
            total.add_parts(train.iter_delta(delta_bytes(ref), like))
        return total

    def close(self, base: str, deltas: Deltas, sliced: bool, rnd: int, step: Outer) -> tuple[str, dict[str, float]]:
        """Make the close of round ``rnd`` on ``base`` here, hold it and evaluate it. The new
        state is held (on disk) first and its outer momentum dropped before the evaluation
        model is built: the close's peak is that model and its activations beside the
        trainer's model, AdamW and residual (so nothing but this frame may hold ``new``).
        Its figures: the evaluation's, and for a job with ``outer_agree`` ``mean_sq``, the
        energy of the round's mean (the close names it; the next outer step weighs it)."""
        new = self.outer(base, deltas, sliced, step, measure=self.job.outer_agree)
        self.states.forget(base)  # on disk: not kept beside the new state and the evaluation
        digest = self.applied(new, rnd, base, step)
        params = new.params
        del new
        loss, metric = self.trainer.evaluate(params, consume=True)
        figures = {"eval_loss": round(loss, 6), self.task.metric_name: round(metric, 6)}
        if self.job.outer_agree and math.isfinite(self.mean_sq) and self.mean_sq > 0:  # finite numbers only
            figures["mean_sq"] = float(f"{self.mean_sq:.6g}")
        return digest, figures

    def applied(self, new: OuterState, rnd: int, base: str, step: Outer) -> str:
        """Hold a close of round ``rnd`` on ``base``; a shard training from an estimate of it
        moves onto it at its next batch."""
        digest = self.states.hold(new)
        self.overlap.landed(rnd, base, digest, step)
        return digest

    def export(self, final: OuterState, out: Path, metrics: dict[str, Any]) -> None:
        train.export_model(final, self.task, out, metrics)


def job_outer(job: JobSpec, rnd: int) -> Outer:
    """The job's own outer step of round ``rnd`` (its outer lr schedule there)."""
    return Outer(train.outer_lr(job.body, rnd), job.outer_momentum)
