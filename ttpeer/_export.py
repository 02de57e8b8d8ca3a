"""``ttpeer export JOB OUT``: a finished job's model, its sidecar, and its task file.

What is written, for ``OUT`` = ``out/model.safetensors`` (``.safetensors`` is added
when missing, so ``export JOB out/model`` writes the same three files and no two
export paths share a sidecar):

- ``out/model.safetensors``: the model (or ensemble bundle), byte for byte the file
  every peer holds;
- ``out/model.json``: the sidecar, naming this model file, the job's ``mode``, the
  task and its hash, and for a task-file job the user's file name (``task_file``);
- ``out/model.task.py``, for a task-file job: the exact task file the job ran, so
  ``ttpeer.load`` and ``predict`` find it beside the model. It is named after the
  export, never after the user's file, so it cannot overwrite the user's edits.

Nothing needs the daemon: the job and its files are read from the home.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from ttpeer.errors import JobError, UsageError

SUFFIX = ".safetensors"


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """``ttpeer export``'s arguments."""
    e = sub.add_parser("export", parents=[common], help="write a finished job's model as safetensors")
    e.add_argument("job", help="job id or a unique prefix")
    e.add_argument("out", type=Path, help="output file (.safetensors is added if missing); its .json sidecar "
                   "and, for a task-file job, its task file (.task.py) are written beside it; with --format hf "
                   "or peft, a new folder")
    e.add_argument("--format", choices=["safetensors", "hf", "peft"], default="safetensors",
                   help="hf: a Hugging Face save_pretrained folder (config, safetensors weights, the tokenizer) that "
                   "transformers loads; peft: a LoRA job's adapters, a folder peft.PeftModel.from_pretrained loads "
                   "over the base; for tasks built with ttpeer.tasks.hf_causal_lm")
    e.add_argument("--merge", action="store_true",
                   help="with --format hf, for a LoRA job: the adapters merged into the base, one plain model")


def run(args: argparse.Namespace, home: Any) -> int:
    """``ttpeer export``. Raises ``UsageError`` for --merge without --format hf."""
    if args.merge and args.format != "hf":
        raise UsageError("--merge goes with --format hf (the adapters merged into the base model)")
    if args.format in ("hf", "peft"):
        return export_hf(home, args.job, args.out, fmt=args.format, merge=args.merge)
    return export(home, args.job, args.out)


def model_path(out: Path) -> Path:
    """The model file ``export`` writes for ``out``: ``out`` itself or ``out.safetensors``."""
    return out if out.suffix == SUFFIX else out.with_name(out.name + SUFFIX)


def task_copy_path(model: Path) -> Path:
    """Where ``export`` puts the task file beside ``model``."""
    return model.with_suffix(".task.py")


def export(home: Any, prefix: str, out: Path) -> int:
    """Copy job ``prefix``'s final model out of ``home``. Raises ``JobError`` for an
    unknown or unfinished job, ``UsageError`` for a bad output path."""
    folder = finished_folder(home, prefix)
    model = model_path(out)
    if not model.parent.is_dir():
        raise UsageError(f"directory {model.parent} does not exist")
    side = json.loads((folder / "final.json").read_text())
    side["model_file"] = model.name  # the daemon's copy says final.safetensors
    side.setdefault("mode", "fused")  # older exports name only ensembles' mode
    task_name = str((side.get("metrics") or {}).get("task", ""))
    written = [model, model.with_suffix(".json")]
    if task_name.endswith(".py"):
        side["task_file"] = task_name
        # Kept under the file's own hash (task_sha256): a task that reads files (a model
        # folder, data) has a source_hash that covers them too.
        source = home.path / "tasks" / f"{side.get('task_sha256') or side['source_hash']}.py"
        if source.is_file():
            shutil.copyfile(source, task_copy_path(model))
            written.append(task_copy_path(model))
    shutil.copyfile(folder / "final.safetensors", model)
    model.with_suffix(".json").write_text(json.dumps(side, indent=2, sort_keys=True) + "\n")
    print("wrote " + ", ".join(str(p) for p in written))
    print(hashlib.sha256(model.read_bytes()).hexdigest())
    return 0


def export_hf(home: Any, prefix: str, out: Path, *, fmt: str = "hf", merge: bool = False) -> int:
    """Write job ``prefix``'s final model as a Hugging Face ``save_pretrained`` folder
    (tasks built with ``ttpeer.tasks.hf_causal_lm``; ``fmt`` ``"peft"``: a LoRA job's
    adapters; ``merge``: them merged into the base). Raises ``JobError`` for an unknown
    or unfinished job, ``UsageError`` for a job that is not a Hugging Face model, or
    not (or not only) adapters where ``fmt`` asks for them."""
    import hashlib
    import json

    from ttpeer.errors import UsageError
    from ttpeer.tasks._hf_export import export_hf as write_folder
    from ttpeer.train import TrainError

    folder = finished_folder(home, prefix)
    if out.parent and not out.parent.exists():
        raise UsageError(f"directory {out.parent} does not exist")
    sidecar = json.loads((folder / "final.json").read_text())
    try:
        weights = write_folder(folder / "final.safetensors", sidecar, out, fmt=fmt, merge=merge)
    except TrainError as exc:
        raise UsageError(str(exc)) from None
    print(f"wrote {out}/ ({', '.join(sorted(p.name for p in out.iterdir()))})")
    print(hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else out)
    return 0


def load_folder(path: Path) -> Any:
    """``ttpeer.load`` of a folder ``export --format hf`` or ``peft`` wrote (``_hf_export``)."""
    from ttpeer.tasks._hf_export import load_folder as load_hf

    return load_hf(path)


def finished_folder(home: Any, prefix: str, needs: str = "export") -> Path:
    """The folder of job ``prefix``'s final model in ``home``. Raises ``JobError`` for an
    unknown or unfinished job (``needs``: what asked, for the message), ``UsageError``."""
    states = home.path / "states"
    matches = [p for p in states.glob(f"{prefix.lower()}*") if p.is_dir()] if states.is_dir() else []
    if len(matches) > 1:
        raise UsageError(f"job prefix {prefix!r} is ambiguous; give more characters")
    # done.json is written last, after the model and its sidecar: until then the job is
    # still finishing here (status says so) and the files may be half there.
    if matches and (matches[0] / "done.json").exists():
        return matches[0]
    if not matches:
        from ttpeer._report import find_job, load_records

        find_job(load_records(home)[0], prefix)  # raises JobError for a job nobody submitted
    raise JobError(f"job {prefix!r} has not finished on this peer (see 'ttpeer status'); "
                   f"{needs} needs its final model")
