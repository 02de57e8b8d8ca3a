"""Ensemble mode: M members, each trained on the full data, voting at inference.

The ensemble state every peer agrees on is an ``OuterState`` (so hashing, the
checkpoint format, disk and blob handling are the fused ones) whose ``params``
hold, for each member ``i``, its weights, its AdamW moments and its step count::

    m0003/w/<name>   weights (every floating entry of the model's state_dict)
    m0003/m/<name>   AdamW first moment  (trainable parameters only)
    m0003/v/<name>   AdamW second moment (trainable parameters only)
    m0003/step       steps taken so far, a 1-element tensor

``momentum`` is all zeros (there is no outer optimizer); it stays so the format is
the fused one. A member's checkpoint is the same layout restricted to its keys.

One unit of a member (``train_unit``) is a pure function of the member's
checkpoint, its variant and the unit number: the data order comes from the
member's seed (``shard_indices`` with one shard), dropout and other randomness
from a generator seeded by (member seed, unit). So any peer that continues a
member, after a steal or a requeue, produces the same bytes the first peer would
have, and the step count carries on.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
import zstandard
from torch import Tensor, nn

from ._compress import _decompress_exact
from ._errors import CheckpointError, DeltaError
from ._inner import EVAL_BATCH, InnerTrainer
from ._lr import shard_first_step
from ._recipe import Recipe
from ._schedule import shard_indices
from ._spec import LoadedTask, fetch_batch
from ._state import OuterState, floating_state, init_state, state_from_bytes, state_to_bytes

MEMBER_MAGIC = b"TTEM"
_MEMBER_HEAD = struct.Struct("<4sI")

Member = Mapping[str, Any]  # {"seed", "lr", "weight_decay"}, as in the job record


def _prefix(i: int) -> str:
    return f"m{i:04d}/"


def _zeros_like(params: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: torch.zeros_like(v) for k, v in params.items()}


def _trainable(task: LoadedTask) -> list[str]:
    """Names of the model's trainable parameters, as ``state_dict`` names them."""
    with torch.random.fork_rng(devices=[]):
        model = task.spec.model()
    return [n for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]


def init_member(task: LoadedTask, i: int, member: Member) -> dict[str, Tensor]:
    """Member ``i``'s tensors at step 0: weights from its own seed, zero moments."""
    weights = init_state(task, int(member["seed"])).params
    pre = _prefix(i)
    out = {f"{pre}w/{n}": t for n, t in weights.items()}
    for n in _trainable(task):
        out[f"{pre}m/{n}"] = torch.zeros_like(weights[n])
        out[f"{pre}v/{n}"] = torch.zeros_like(weights[n])
    out[f"{pre}step"] = torch.zeros(1)
    return out


def init_ensemble(task: LoadedTask, members: Sequence[Member]) -> OuterState:
    """The ensemble state before any training."""
    params: dict[str, Tensor] = {}
    for i, member in enumerate(members):
        params.update(init_member(task, i, member))
    params = dict(sorted(params.items()))
    return OuterState(params=params, momentum=_zeros_like(params))


def member_of(state: OuterState, i: int) -> OuterState:
    """Member ``i``'s checkpoint, cut out of an ensemble state."""
    pre = _prefix(i)
    params = {k: v for k, v in state.params.items() if k.startswith(pre)}
    if not params:
        raise CheckpointError(f"the ensemble state has no member {i}")
    return OuterState(params=params, momentum=_zeros_like(params))


def member_steps(state: OuterState, i: int) -> int:
    """How many steps member ``i`` has taken."""
    return int(state.params[f"{_prefix(i)}step"].item())


def member_count(state: OuterState) -> int:
    return len({k.split("/", 1)[0] for k in state.params})


# -- one unit ------------------------------------------------------------------------


def train_unit(task: LoadedTask, state: OuterState, i: int, member: Member, unit: int, inner_steps: int,
               batch_size: int, *, device: str = "cpu", should_stop: Callable[[], bool] | None = None,
               recipe: Recipe | None = None, kept: Sequence[int] | None = None) -> tuple[OuterState | None, int]:
    """Train member ``i`` of the ensemble ``state`` for unit ``unit`` (``inner_steps`` AdamW
    steps over the training data, or its samples ``kept`` (all but the job's held-out ones,
    ``_select.holdout_split``), in the member's own order; ``recipe``: precision,
    micro-batch and lr schedule, whose global step is ``unit x inner_steps + step``). Returns the member's new
    checkpoint and the samples trained, or ``(None, 0)`` if stopped before the unit's
    end: a unit is published whole or not at all.

    Raises CheckpointError if ``state`` does not hold member ``i`` of this task, and
    whatever ``InnerTrainer.train_shard`` raises (TaskError, TrainError).
    """
    pre = _prefix(i)
    seed = int(member["seed"])
    trainer = InnerTrainer(task, lr=float(member["lr"]), weight_decay=float(member["weight_decay"]),
                           device=device, seed=seed, recipe=recipe)
    names = list(floating_state(trainer.model))
    try:
        weights = {n: state.params[f"{pre}w/{n}"] for n in names}
    except KeyError:
        raise CheckpointError(f"the ensemble state does not hold member {i} of task {task.name}") from None
    trainer.start(OuterState(params=weights, momentum=weights))
    steps = member_steps(state, i)
    params = dict(trainer.model.named_parameters())
    trainable = [n for n, p in params.items() if p.requires_grad and p.is_floating_point()]
    if steps > 0:
        for n in trainable:
            trainer.optimizer.state[params[n]] = {
                "step": torch.tensor(float(steps)),
                "exp_avg": state.params[f"{pre}m/{n}"].to(trainer.device, copy=True),
                "exp_avg_sq": state.params[f"{pre}v/{n}"].to(trainer.device, copy=True),
            }
    order = shard_indices(task.n_train if kept is None else len(kept), seed, unit, 0, 1, inner_steps, batch_size)
    if kept is not None:
        order = [[kept[k] for k in batch] for batch in order]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int.from_bytes(hashlib.sha256(f"{seed}:{unit}".encode()).digest()[:7], "little"))
        samples = trainer.train_shard(order, should_stop, first_step=shard_first_step(unit, inner_steps))
    if samples < inner_steps * batch_size:
        return None, 0
    out = {f"{pre}w/{n}": t for n, t in floating_state(trainer.model).items()}
    for n in trainable:
        moments = trainer.optimizer.state[params[n]]
        out[f"{pre}m/{n}"] = moments["exp_avg"].detach().to("cpu", torch.float32, copy=True)
        out[f"{pre}v/{n}"] = moments["exp_avg_sq"].detach().to("cpu", torch.float32, copy=True)
    out[f"{pre}step"] = torch.tensor([float(steps + inner_steps)])
    out = dict(sorted(out.items()))
    return OuterState(params=out, momentum=_zeros_like(out)), samples


# -- member checkpoints on the wire --------------------------------------------------


def encode_member(i: int, checkpoint: OuterState) -> bytes:
    """A member's checkpoint as blob bytes: ``TTEM | u32 member | zstd(state bytes)``
    (the zero momentum compresses away)."""
    frame = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(state_to_bytes(checkpoint))
    return _MEMBER_HEAD.pack(MEMBER_MAGIC, i) + frame


def decode_member(data: bytes, like: OuterState) -> tuple[int, OuterState]:
    """Parse a member checkpoint blob against the ensemble state ``like``; safe on
    hostile input (exact sizes, no decompression bomb). Raises CheckpointError."""
    if len(data) < _MEMBER_HEAD.size:
        raise CheckpointError("member checkpoint is truncated")
    magic, i = _MEMBER_HEAD.unpack(data[:_MEMBER_HEAD.size])
    if magic != MEMBER_MAGIC:
        raise CheckpointError("not a ttpeer member checkpoint (bad magic)")
    want = member_of(like, i)  # raises for a member the ensemble does not have
    expected = _encoded_size(want)
    try:
        raw = _decompress_exact(data[_MEMBER_HEAD.size:], expected)
    except DeltaError as exc:
        raise CheckpointError(f"member {i} checkpoint: {exc}") from None
    return i, state_from_bytes(raw, like=want)


def _encoded_size(state: OuterState) -> int:
    header = 12 + sum(2 + len(n.encode()) + 2 + 8 * t.ndim for n, t in state.params.items())
    return header + 2 * 4 * sum(t.numel() for t in state.params.values())


def combine(base: OuterState, checkpoints: Sequence[tuple[int, OuterState]]) -> OuterState:
    """The next ensemble state: ``base`` with each given member replaced by its new
    checkpoint. Raises CheckpointError if a member appears twice."""
    seen = [i for i, _ in checkpoints]
    if len(set(seen)) != len(seen):
        raise CheckpointError(f"a round names member checkpoints {sorted(seen)}: one per member")
    params = dict(base.params)
    for _i, ckpt in checkpoints:
        params.update(ckpt.params)
    return OuterState(params=params, momentum=base.momentum)


# -- the vote ------------------------------------------------------------------------


class Ensemble(nn.Module):
    """The members' vote: ``forward`` returns the average of their softmax probabilities
    over the last dimension, member ``k`` counted ``weights[k]`` times (all once when not
    given; a member of weight 0 is not run)."""

    def __init__(self, members: Sequence[nn.Module], weights: Sequence[int] | None = None) -> None:
        super().__init__()
        weights = [1] * len(members) if weights is None else list(weights)
        if len(weights) != len(members) or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"need one weight >= 0 per member, not all 0; got {weights} for {len(members)}")
        self.weights = [w for w in weights if w]
        self.members = nn.ModuleList(m for m, w in zip(members, weights, strict=True) if w)

    def forward(self, x: Tensor) -> Tensor:
        return _vote(self.weights, (F.softmax(m(x), dim=-1) for m in self.members))


def _vote(weights: Sequence[int], probs: Iterable[Tensor]) -> Tensor:
    """The members' probabilities averaged, member ``k``'s counted ``weights[k]`` times."""
    # A sum of tensors is one: a vote has a member of weight > 0 (``Ensemble`` checks it).
    return cast(Tensor, sum(w * p for w, p in zip(weights, probs, strict=True) if w)) / sum(weights)


def member_models(task: LoadedTask, state: OuterState, device: str = "cpu") -> list[nn.Module]:
    """Every member's model with its trained weights, in eval mode."""
    models = []
    for i in range(member_count(state)):
        with torch.random.fork_rng(devices=[]):
            model = task.spec.model()
        pre = f"{_prefix(i)}w/"
        target = model.state_dict()
        with torch.no_grad():
            for name, t in state.params.items():
                if name.startswith(pre):
                    target[name[len(pre):]].copy_(t)
        models.append(model.to(device).eval())
    return models


def evaluate(task: LoadedTask, state: OuterState, device: str = "cpu", weights: Sequence[int] | None = None,
             models: Sequence[nn.Module] | None = None) -> tuple[list[tuple[float, float]], tuple[float, float]]:
    """Test ``(loss, metric)`` of every member and of the vote (member ``k`` counted
    ``weights[k]`` times; all once when not given). The vote is scored by the task's own
    loss and metric on log(averaged probabilities), which is what cross-entropy and
    argmax-accuracy need from logits. ``models``: the state's ``member_models``, if built."""
    models = list(models) if models is not None else member_models(task, state, device)
    weights = [1] * len(models) if weights is None else list(weights)
    sums = [[0.0, 0.0] for _ in range(len(models) + 1)]
    n_test = task.n_test
    with torch.no_grad():
        for begin in range(0, n_test, EVAL_BATCH):
            idx = list(range(begin, min(begin + EVAL_BATCH, n_test)))
            x, y = fetch_batch(task.test, idx)
            x, y = x.to(device), y.to(device)
            probs = []
            for k, model in enumerate(models):
                out = model(x)
                probs.append(F.softmax(out, dim=-1))
                sums[k][0] += float(task.spec.loss(out, y)) * len(idx)
                sums[k][1] += float(task.spec.metric(out, y)) * len(idx)
            vote = _vote(weights, probs).clamp_min(1e-12).log()
            sums[-1][0] += float(task.spec.loss(vote, y)) * len(idx)
            sums[-1][1] += float(task.spec.metric(vote, y)) * len(idx)
    scores = [(loss / n_test, metric / n_test) for loss, metric in sums]
    return scores[:-1], scores[-1]
