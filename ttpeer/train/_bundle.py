"""The ensemble bundle: one safetensors file holding every member's weights
(``member0003.<name>``), and its JSON sidecar.

The file is written like a fused export (``_export``: sorted keys, fixed header, so
every peer writes the same bytes). The sidecar adds ``mode: "ensemble"``, one
object per member under ``members`` (its seed, variant, steps, its ``weight`` in the vote,
its test scores and its ``holdout`` scores on the training samples no member trained on)
and the vote's scores under ``ensemble``. ``load_bundle`` reads either kind back; a
bundle without weights votes with every member once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from torch import nn

from ._atomic import write_atomic
from ._ensemble import Ensemble, Member, member_count, member_steps
from ._errors import CheckpointError
from ._export import _safetensors_bytes, load_model
from ._spec import LoadedTask
from ._state import OuterState, state_hash

Scores = tuple[list[tuple[float, float]], tuple[float, float]]  # members' and the vote's (loss, metric)


def export_ensemble(state: OuterState, task: LoadedTask, members: Sequence[Member], out: Path,
                    metrics: dict[str, Any], scores: Scores, weights: Sequence[int] | None = None,
                    held: Scores | None = None) -> str:
    """Write the bundle of ensemble ``state`` to ``out`` and its ``.json`` sidecar;
    return the bundle's sha256. ``scores``: ``evaluate``'s result (test) with the vote
    ``weights`` (all 1 when not given); ``held``: the same on the held-out training samples,
    if the job held any out. Raises OSError if ``out`` is not writable."""
    weights = list(weights) if weights is not None else [1] * len(members)
    out = Path(out)
    tensors = {}
    for name, t in state.params.items():
        member, part, rest = name.split("/", 2) if name.count("/") >= 2 else (name, "", "")
        if part == "w":
            tensors[f"member{member[1:]}.{rest}"] = t
    data = _safetensors_bytes(OuterState(params=tensors, momentum={}),
                              {"ttpeer": "1", "task": task.name, "mode": "ensemble"})
    digest = hashlib.sha256(data).hexdigest()
    metric = task.metric_name
    member_scores, (vote_loss, vote_metric) = scores
    held_members, held_vote = held if held is not None and held[0] else ([None] * len(members), None)
    sidecar = {
        "mode": "ensemble",
        "task": task.name,
        "source_hash": task.source_hash,
        "param_count": sum(t.numel() for t in tensors.values()),
        "state_hash": state_hash(state),
        "model_file": out.name,
        "model_sha256": digest,
        "metric_name": metric,
        "metrics": metrics,
        **({"task_sha256": task.own_hash} if task.own_hash and task.own_hash != task.source_hash else {}),
        "members": [
            {"index": i, "seed": m["seed"], "lr": m["lr"], "weight_decay": m["weight_decay"],
             "steps": member_steps(state, i), "weight": w, metric: round(score, 6), "eval_loss": round(loss, 6),
             "holdout": _scored(h, metric)}
            for i, (m, (loss, score), w, h) in enumerate(zip(members, member_scores, weights, held_members,
                                                             strict=True))
        ],
        "ensemble": {metric: round(vote_metric, 6), "eval_loss": round(vote_loss, 6),
                     "members": member_count(state), "voting": sum(1 for w in weights if w),
                     "holdout": _scored(held_vote, metric)},
    }
    write_atomic(out, data)
    write_atomic(out.with_suffix(".json"), (json.dumps(sidecar, indent=2, sort_keys=True) + "\n").encode())
    return digest


def _scored(score: tuple[float, float] | None, metric: str) -> dict[str, float] | None:
    return None if score is None else {"eval_loss": round(score[0], 6), metric: round(score[1], 6)}


def read_sidecar(path: Path) -> dict[str, Any]:
    """The JSON sidecar next to a model file. Raises CheckpointError."""
    side = Path(path).with_suffix(".json")
    try:
        obj = json.loads(side.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{side} is missing: a ttpeer model comes with its .json sidecar") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{side} is not a ttpeer sidecar: {exc}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("task"), str):
        raise CheckpointError(f"{side} is not a ttpeer sidecar (no task name)")
    return obj


def load_bundle(path: Path, task: LoadedTask) -> nn.Module:
    """A fused export as the task's model, or an ensemble bundle as an ``Ensemble``
    (returning averaged probabilities), in eval mode. Raises CheckpointError if the
    file does not match its sidecar or the task."""
    path = Path(path)
    side = read_sidecar(path)
    if side.get("source_hash") not in (None, task.source_hash):
        raise CheckpointError(f"{path} was trained on a different {side['task']!r} task "
                              f"(hash {str(side['source_hash'])[:12]}, this one {task.source_hash[:12]})")
    data = path.read_bytes()
    if side.get("model_sha256") not in (None, hashlib.sha256(data).hexdigest()):
        raise CheckpointError(f"{path} does not match the sha256 its sidecar records")
    if side.get("mode", "fused") != "ensemble":
        return load_model(path, task)
    try:
        tensors = safetensors_load(data)
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a safetensors file: {exc}") from exc
    listed = side.get("members") or []
    count = len(listed)
    weights = [m.get("weight", 1) if isinstance(m, dict) else 1 for m in listed]
    if not all(type(w) is int and w >= 0 for w in weights) or (weights and not any(weights)):
        raise CheckpointError(f"{path}: the sidecar's member weights are not whole numbers >= 0: {weights}")
    models = []
    for i in range(count):
        pre = f"member{i:04d}."
        part = {k[len(pre):]: v for k, v in tensors.items() if k.startswith(pre)}
        model = task.spec.model()
        expected = {n: t.shape for n, t in model.state_dict().items() if t.is_floating_point()}
        if part.keys() != expected.keys() or any(part[n].shape != s for n, s in expected.items()):
            raise CheckpointError(f"{path}: member {i} does not match task {task.name}")
        model.load_state_dict(part, strict=False)
        models.append(model.eval())
    if not models:
        raise CheckpointError(f"{path}: the sidecar lists no members")
    return Ensemble(models, weights).eval()
