"""The core install is what a headless trainer needs; plots, TensorBoard, Prometheus and the
demo task's data generator are extras, and each says what to install when it is missing.

A package is made "not installed" by putting None in ``sys.modules`` (importing it then
fails, as it does without it) or by ``find_spec`` answering None for it.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import time
import tomllib
from pathlib import Path

import pytest

from ttpeer.cli import main
from ttpeer.daemon import Home

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = {"mnist1d": "mnist1d", "report": "matplotlib", "board": "tensorboard", "metrics": "prometheus-client"}


def _name(requirement: str) -> str:
    return requirement.split(">")[0].split("=")[0].split("[")[0].strip().lower()


def test_the_core_leaves_out_what_a_headless_trainer_does_not_need():
    core = {_name(r) for r in PYPROJECT["dependencies"]}
    assert core.isdisjoint(EXTRAS.values()) and "scipy" not in core
    assert {"torch", "trio", "httpx", "cryptography", "zstandard"} <= core
    extras = PYPROJECT["optional-dependencies"]
    for extra, package in EXTRAS.items():
        assert [_name(r) for r in extras[extra]] == [package]
    (everything,) = extras["all"]
    assert set(everything.split("[")[1].rstrip("]").split(",")) == {"hf", "parquet", *EXTRAS}


def _missing(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == module else real(name, *a))
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "alice"
    Home(path).create_pool("https://127.0.0.1:1", "sha256:" + "0" * 64, "alice", time.time())
    return path


def test_report_without_matplotlib_says_which_extra(monkeypatch, capsys, home, tmp_path):
    _missing(monkeypatch, "matplotlib")
    assert main(["report", "job1", str(tmp_path / "r.html"), "--home", str(home)]) != 0
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install 'ttpeer[report]'" in err
    assert not (tmp_path / "r.html").exists()


def test_metrics_without_prometheus_client_stop_up_before_the_daemon_starts(monkeypatch, capsys, home):
    _missing(monkeypatch, "prometheus_client")
    assert main(["up", "--metrics", "127.0.0.1:9464", "--home", str(home)]) != 0
    assert "pip install 'ttpeer[metrics]'" in capsys.readouterr().err


def test_join_with_metrics_but_no_prometheus_client_keeps_the_token_unused(monkeypatch, capsys, home, tmp_path):
    assert main(["invite", "--home", str(home)]) == 0
    token = capsys.readouterr().out.strip().splitlines()[-1]
    _missing(monkeypatch, "prometheus_client")
    monkeypatch.setenv("TTPEER_TOKEN", token)
    bob = tmp_path / "bob"
    assert main(["join", "--metrics", "127.0.0.1:9464", "--home", str(bob)]) != 0
    assert "pip install 'ttpeer[metrics]'" in capsys.readouterr().err
    assert not (bob / "pool.json").exists() and not any(bob.glob("*key*"))  # nothing enrolled


def test_the_mnist1d_task_without_its_package_names_the_extra(monkeypatch, tmp_path):
    from ttpeer.train import TaskError, load_task

    _missing(monkeypatch, "mnist1d")
    with pytest.raises(TaskError, match=r"pip install 'ttpeer\[mnist1d\]'"):
        load_task("mnist1d:samples=200", data_dir=tmp_path)


def test_the_board_without_tensorboard_is_one_line_and_the_daemon_goes_on(monkeypatch, caplog, tmp_path):
    from ttpeer.daemon.service._board import Board

    _missing(monkeypatch, "tensorboard")
    board = Board.__new__(Board)  # only update()'s handling is under test: _update imports the writer
    board.root, board._disabled = tmp_path, False
    attempts = []

    def write() -> None:
        attempts.append(1)
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: F401

    board._update = write
    with caplog.at_level(logging.WARNING, logger="ttpeer.daemon"):
        board.update()
        board.update()
    assert attempts == [1] and board._disabled  # said once, then no more tries
    (record,) = caplog.records
    assert record.exc_info is None and "pip install 'ttpeer[board]'" in record.getMessage()


@pytest.mark.slow  # loads torch
def test_a_headless_worker_warms_up_without_the_demo_data_and_says_nothing(monkeypatch, caplog, home):
    import trio

    from ttpeer.daemon.worker._torch import TorchExecutor

    _missing(monkeypatch, "mnist1d")
    with caplog.at_level(logging.WARNING, logger="ttpeer.daemon"):
        trio.run(TorchExecutor(Home(home)).warm_up)
    assert caplog.records == []  # no "could not prepare the mnist1d data" at every start
    assert not list(home.glob("data/mnist1d*"))
