"""``ttpeer export`` writes what loading needs, and ``ttpeer.load`` finds it: the
sidecar names its own model file, the mode and the user's task file; the task file is
found by its hash beside the model or in a home; a file of the right name with other
bytes is called a different file."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

import ttpeer
from ttpeer.cli import main
from ttpeer.daemon import Home
from ttpeer.errors import UsageError
from ttpeer.train import export_model, init_state, load_task

FIXTURE = Path(__file__).parent / "fixtures" / "task_linear.py"
JOB = "c0ffee" + "0" * 58


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home as a peer leaves it after a task-file job: the task copy named by its
    hash, and the job's final files (written by the daemon's own export function)."""
    path = tmp_path / "home"
    Home(path).create_pool("https://127.0.0.1:1", "sha256:" + "0" * 64, "alice", time.time())
    digest = hashlib.sha256(FIXTURE.read_bytes()).hexdigest()
    (path / "tasks").mkdir()
    kept = path / "tasks" / f"{digest}.py"
    shutil.copyfile(FIXTURE, kept)
    task = load_task(str(kept), path / "data")
    folder = path / "states" / JOB
    folder.mkdir(parents=True)
    metrics = {"job": JOB, "task": "my_task.py", "rounds": 2, "eval": {"accuracy": 0.5}}
    export_model(init_state(task, 1), task, folder / "final.safetensors", metrics)
    (folder / "done.json").write_text(json.dumps(metrics))
    return path


def _export(capsys, home: Path, out: Path) -> list[str]:
    assert main(["export", JOB[:8], str(out), "--home", str(home)]) == 0
    return capsys.readouterr().out.splitlines()


def test_the_sidecar_names_its_own_file_the_mode_and_the_users_task_file(home, tmp_path, capsys):
    lines = _export(capsys, home, tmp_path / "model.safetensors")
    side = json.loads((tmp_path / "model.json").read_text())
    assert side["model_file"] == "model.safetensors" and side["mode"] == "fused"
    assert side["task_file"] == "my_task.py" and side["source_hash"] == hashlib.sha256(FIXTURE.read_bytes()).hexdigest()
    assert (tmp_path / "model.task.py").read_bytes() == FIXTURE.read_bytes()
    assert lines[-1] == hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()


def test_one_sidecar_per_export_path(home, tmp_path, capsys):
    """'export JOB out/p' and 'export JOB out/p.safetensors' write the same three files."""
    first = _export(capsys, home, tmp_path / "p")
    files = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert files == ["p.json", "p.safetensors", "p.task.py"]
    assert _export(capsys, home, tmp_path / "p.safetensors") == first
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == files


def test_load_finds_the_task_file_beside_the_model_or_in_the_home(home, tmp_path, capsys):
    _export(capsys, home, tmp_path / "m")
    model = ttpeer.load(tmp_path / "m.safetensors", home=tmp_path / "no-home")  # the copy beside it
    assert isinstance(model, torch.nn.Module)
    (tmp_path / "m.task.py").unlink()
    with pytest.raises(UsageError, match=r"trained on task file my_task\.py.*pass the original file"):
        ttpeer.load(tmp_path / "m.safetensors", home=tmp_path / "no-home")
    assert isinstance(ttpeer.load(tmp_path / "m.safetensors", home=home), torch.nn.Module)  # HOME/tasks
    shutil.copyfile(FIXTURE, tmp_path / "my_task.py")  # the user's own file, unchanged
    assert isinstance(ttpeer.load(tmp_path / "m.safetensors", home=tmp_path / "no-home"), torch.nn.Module)


def test_a_commented_task_file_is_named_as_a_different_file(home, tmp_path, capsys):
    _export(capsys, home, tmp_path / "m")
    (tmp_path / "m.task.py").unlink()
    (tmp_path / "my_task.py").write_bytes(FIXTURE.read_bytes() + b"# one more comment\n")
    with pytest.raises(UsageError, match=r"my_task\.py is a different file"):
        ttpeer.load(tmp_path / "m.safetensors", home=tmp_path / "no-home")
    with pytest.raises(UsageError, match="is a different file from the task file this model was trained on"):
        ttpeer.load(tmp_path / "m.safetensors", task=tmp_path / "my_task.py")


def test_predict_finds_the_task_in_its_home(home, tmp_path, capsys):
    _export(capsys, home, tmp_path / "m")
    (tmp_path / "m.task.py").unlink()
    rows = tmp_path / "rows.txt"
    rows.write_text("1 2 3 4 5 6 7 8\n0 0 0 0 0 0 0 0\n")
    assert main(["predict", str(tmp_path / "m.safetensors"), str(rows), "--home", str(home)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_export_of_a_job_that_has_not_finished(home, tmp_path, capsys):
    (home / "states" / JOB / "done.json").unlink()
    assert main(["export", JOB[:8], str(tmp_path / "m"), "--home", str(home)]) == 1
    assert "has not finished on this peer" in capsys.readouterr().err
    assert not (tmp_path / "m.safetensors").exists()
