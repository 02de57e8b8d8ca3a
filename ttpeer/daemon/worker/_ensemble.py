"""An ensemble job on this peer: diverse members trained on the full data, combined by a
vote weighed on held-out samples (``train/_ensemble.py``, ``train/_select.py``).

A held state is the whole ensemble. A shard of a round is one unit of one member,
continued from that member's checkpoint in the round's state; what a peer publishes is
the member's new checkpoint, and a round's close puts every member's checkpoint into
the state. Every close weighs the members by greedy selection on the held-out split
(the same on every peer, so the bundle is bit-identical) and evaluates the vote.

Every method runs in a worker thread; the executor's locks order them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ttpeer import train
from ttpeer.errors import JobError
from ttpeer.proto import JobSpec, Outer, PublishDelta, Train
from ttpeer.train import LoadedTask, OuterState

from .._executor import Deltas, delta_bytes
from ._jobstates import JobStates


class Ensemble:
    """One ensemble job's local work on this peer, on ``device``."""

    # A member's checkpoint is its own tensors, apart from the unit in training: publishing
    # it does not wait for that unit.
    delta_locked = False

    def __init__(self, job: JobSpec, task: LoadedTask, trainer: train.InnerTrainer, states: JobStates, *,
                 device: str) -> None:
        self.job, self.task, self.trainer, self.states, self.device = job, task, trainer, states, device
        # Member checkpoints trained here and not yet published, by (round, member).
        self.units: dict[tuple[int, int], OuterState] = {}
        # The training samples the vote is weighed on, and those the members train on.
        self.held: list[int] = []
        self.kept: list[int] | None = None
        if job.holdout:
            self.held, self.kept = train.holdout_split(task.n_train, job.holdout, job.seed)

    def train(self, eff: Train, should_stop: Callable[[], bool]) -> int:
        """One unit of member ``eff.shard``, continued from its checkpoint in ``eff.base``."""
        member, job = eff.shard, self.job
        ckpt, samples = train.train_unit(
            self.task, self.states.load(eff.base), member, dict(job.members[member]), eff.round,
            job.inner_steps, job.batch_size, device=self.device, should_stop=should_stop,
            recipe=self.trainer.recipe, kept=self.kept)
        if ckpt is not None:
            # Units of closed rounds were covered by someone else first: drop them.
            self.units = {k: v for k, v in self.units.items() if k[0] >= eff.round}
            self.units[(eff.round, member)] = ckpt
        return samples

    def pieces(self, rnd: int, shards: list[int], inner_steps: int, first: int) -> dict[str, Any]:
        """Members read the whole training set: nothing to fetch by pieces."""
        return {}

    def delta(self, eff: PublishDelta) -> tuple[bytes, dict[str, float]]:
        """The member's checkpoint this peer trained for the round."""
        (member,) = eff.shards
        ckpt = self.units.pop((eff.round, member), None)
        if ckpt is None:
            raise JobError(f"member {member} of round {eff.round} was not trained on this peer")
        return train.encode_member(member, ckpt), {
            "fp32_bytes": float(4 * sum(t.numel() for t in ckpt.params.values())),
            **self.trainer.recipe.metrics(self.job.batch_size)}

    def outer(self, base: str, deltas: Deltas, sliced: bool, step: Outer) -> OuterState:
        """The round's member checkpoints in place of their members in ``base`` (no outer step)."""
        try:
            parts = [train.decode_member(delta_bytes(ref), self.states.like) for ref, _samples in deltas]
        except train.CheckpointError as exc:
            raise JobError(str(exc)) from None
        if sorted(i for i, _ckpt in parts) != list(range(len(self.job.members))):
            raise JobError(f"round of job {self.job.id[:12]} does not hold one checkpoint per member "
                           f"(got members {sorted(i for i, _ckpt in parts)})")
        return train.combine(self.states.load(base), parts)

    def close(self, base: str, deltas: Deltas, sliced: bool, rnd: int, step: Outer) -> tuple[str, dict[str, float]]:
        """Make the close of round ``rnd`` on ``base`` here, hold it and evaluate the vote,
        weighed on the held-out samples. The weights travel with the figures (``weights``,
        one a member)."""
        new = self.outer(base, deltas, sliced, step)
        self.states.forget(base)
        weights, models, _held = train.weigh_members(self.task, new, self.held, self.device)
        members, (loss, metric) = train.evaluate_ensemble(self.task, new, self.device, weights, models)
        best = max(m for _loss, m in members)
        return self.states.hold(new), {"eval_loss": round(loss, 6), self.task.metric_name: round(metric, 6),
                                       "best_member": round(best, 6), "weights": weights}  # type: ignore[dict-item]

    def applied(self, new: OuterState, rnd: int, base: str, step: Outer) -> str:
        return self.states.hold(new)

    def export(self, final: OuterState, out: Path, metrics: dict[str, Any]) -> None:
        """The bundle with the close's weights and each member's and the vote's figures."""
        weights = list(metrics.get("weights") or [1] * len(self.job.members))
        _w, models, (probs, target) = train.weigh_members(self.task, final, self.held, self.device)
        scores = train.evaluate_ensemble(self.task, final, self.device, weights, models)
        held = train.holdout_scores(self.task, probs, target, weights)
        train.export_ensemble(final, self.task, list(self.job.members), out, metrics, scores, weights, held)
