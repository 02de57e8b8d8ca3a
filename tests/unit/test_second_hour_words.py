"""What the client commands say, as a user reads it: ``wait`` on a job some peers failed,
a silent peer in ``status``, one round numbering in ``status`` and ``--watch``, and
suggested commands that carry the ``--home`` and ``--config`` the user gave. The daemon's
answer is a status object (the fixture's schema); real-process checks are in
tests/integration/test_second_hour.py."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
from rich.console import Console

from ttpeer import _status_cmds
from ttpeer._suggest import carry, takers
from ttpeer._watch import render
from ttpeer.cli import build_parser, main
from ttpeer.daemon import Home

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "status.json").read_text())
BOB, CAROL = "b0" * 32, "c0" * 32


def _status(*, job: dict | None = None, peers: list[dict] | None = None) -> dict:
    st = copy.deepcopy(FIXTURE)
    st["jobs"][0].update(job or {})
    st["peers"] += peers or []
    return st


def _answering(monkeypatch: pytest.MonkeyPatch, st: dict) -> None:
    monkeypatch.setattr(_status_cmds, "_status_obj", lambda home: st)


def _peer(pid: str, name: str, seen: float, liveness: str) -> dict:
    return {"id": pid, "name": name, "role": "member", "self": False, "last_seen_s": seen, "liveness": liveness,
            "rate": 1.0}


def _failed(pid: str, name: str) -> dict:
    return {"peer": pid, "name": name, "reason": "data path '/d' does not exist on this machine", "need_bytes": 0,
            "have_bytes": 0, "code": "failed"}


# -- wait --------------------------------------------------------------------------------

def test_wait_on_a_job_done_without_some_peers_names_them_and_exits_4(monkeypatch, tmp_path, capsys):
    st = _status(job={"declines": [_failed(BOB, "bob"), _failed(CAROL, "carol")]})
    _answering(monkeypatch, st)
    job = st["jobs"][0]["id"]
    assert main(["wait", job[:8], "--home", str(tmp_path)]) == _status_cmds.WAIT_PARTIAL == 4
    out, err = capsys.readouterr()
    assert out.startswith(f"job {job[:12]} done without bob, carol: 50 rounds")
    assert err.count("does not exist on this machine") == 2 and f"failed on bob ({BOB[:12]})" in err
    assert main(["wait", job[:8], "--json", "--home", str(tmp_path)]) == 4
    said = json.loads(capsys.readouterr().out)
    assert said["state"] == "done" and [p["name"] for p in said["failed_peers"]] == ["bob", "carol"]


def test_wait_on_a_job_every_peer_trained_exits_0_and_a_decline_for_memory_is_no_failure(monkeypatch, tmp_path,
                                                                                         capsys):
    memory = {**_failed(BOB, "bob"), "code": "memory", "reason": "needs 9 GiB, has 4"}
    st = _status(job={"declines": [memory]})
    _answering(monkeypatch, st)
    assert main(["wait", st["jobs"][0]["id"][:8], "--home", str(tmp_path)]) == 0
    assert "without" not in capsys.readouterr().out
    assert main(["wait", st["jobs"][0]["id"][:8], "--json", "--home", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["failed_peers"] == []


def test_wait_on_a_job_that_finished_before_this_machine_joined_says_so(monkeypatch, tmp_path, capsys):
    st = _status(job={"state": "skipped"})
    _answering(monkeypatch, st)
    assert main(["wait", st["jobs"][0]["id"][:8], "--home", str(tmp_path)]) == 1
    assert "submitted before this machine joined and finished without it" in capsys.readouterr().err


# -- a silent peer -----------------------------------------------------------------------

def test_status_shows_a_peer_silent_past_the_lease_and_what_becomes_of_its_shards(monkeypatch, tmp_path, capsys):
    running = {"state": "running", "round": 3, "lease_s": 30.0, "peers": [
        {"id": CAROL, "name": "carol", "started": False}, {"id": BOB, "name": "bob", "started": False}]}
    st = _status(job=running, peers=[_peer(BOB, "bob", 4.0, "alive"), _peer(CAROL, "carol", 16.0, "suspect")])
    _answering(monkeypatch, st)
    assert main(["status", "--home", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    carol = next(line for line in out.splitlines() if line.strip().startswith("carol"))
    since = time.strftime("%H:%M", time.localtime(time.time() - 16))
    assert f"silent since {since}" in carol and "(16s)" in carol
    assert "the shards it claimed go back to the pool in 14s" in carol
    bob = next(line for line in out.splitlines() if line.strip().startswith("bob"))
    assert "heard 4s ago" in bob
    assert "not started yet (preparing the job): bob\n" in out  # carol is silent, not preparing

    st["peers"][-1].update(last_seen_s=None, liveness="unknown")  # never heard from: no claim either way
    assert main(["status", "--home", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "never heard from" in out and "not started yet (preparing the job): bob\n" in out
    st["peers"][-1].update(last_seen_s=16.0, liveness="suspect")

    st["peers"][-1].update(last_seen_s=45.0, liveness="dead")
    assert main(["status", "--home", str(tmp_path)]) == 0
    assert "went back to the pool 15s ago (its 30s lease)" in capsys.readouterr().out


def test_a_peer_silent_past_the_lease_but_not_yet_suspected_is_silent_too():
    job = {"state": "running", "lease_s": 10.0}
    assert _status_cmds._silent(_peer(CAROL, "carol", 12.0, "alive"), [job])
    assert not _status_cmds._silent(_peer(CAROL, "carol", 8.0, "alive"), [job])
    assert not _status_cmds._silent(_peer(CAROL, "carol", 8.0, "alive"), [])
    assert _status_cmds.silent_line(60.0, None).endswith("(60s); no job is running")


# -- one round numbering -----------------------------------------------------------------

def test_status_and_the_watch_panel_count_rounds_alike(monkeypatch, tmp_path, capsys):
    st = _status(job={"state": "running", "round": 0, "rounds": 4})
    _answering(monkeypatch, st)
    assert main(["status", "--home", str(tmp_path)]) == 0
    assert ": round 1/4," in capsys.readouterr().out  # the first round trains
    console = Console(width=200, record=True)
    console.print(render(st))
    panel = console.export_text()
    assert "1/4" in panel and "0/4" not in panel

    st["jobs"][0].update(state="done", round=4)
    assert main(["status", "--home", str(tmp_path)]) == 0
    assert ": round 4/4," in capsys.readouterr().out


# -- suggested commands carry the options given ------------------------------------------

COMMANDS = takers(build_parser())


@pytest.mark.parametrize("said, carried", [
    ("start it with 'ttpeer up'", "start it with 'ttpeer up --home ./lab'"),
    ("run 'ttpeer data add PATH --name NAME'", "run 'ttpeer data add PATH --name NAME --home ./lab'"),
    ("'ttpeer wait JOB && ttpeer export JOB m.st'",
     "'ttpeer wait JOB --home ./lab && ttpeer export JOB m.st --home ./lab'"),
    ("'ttpeer status | head -1'", "'ttpeer status --home ./lab | head -1'"),
    ("`sudo ttpeer service install`", "`sudo ttpeer service install --home ./lab`"),
    ("'ttpeer up --home other'", "'ttpeer up --home other'"),  # chosen already
    ("'ttpeer relay --listen 0.0.0.0:8443 --data D'", "'ttpeer relay --listen 0.0.0.0:8443 --data D'"),  # no home
    ("'ttpeer relay ls'", "'ttpeer relay ls --home ./lab'"),
    ("ask the pool admin for a new one ('ttpeer invite')", "ask the pool admin for a new one ('ttpeer invite')"),
    ("ttpeer up, unquoted, is prose", "ttpeer up, unquoted, is prose"),
])
def test_a_suggested_command_carries_the_home_given(said, carried):
    assert carry(said, ["--home", "./lab"], COMMANDS) == carried


def test_a_path_that_needs_quoting_is_quoted_inside_the_suggestion():
    assert carry("'ttpeer up'", ["--home", "/tmp/my lab"], COMMANDS) == """'ttpeer up --home "/tmp/my lab"'"""


def test_the_commands_print_their_suggestions_with_the_users_home_and_config(tmp_path, capsys):
    home, config = tmp_path / "no such home", tmp_path / "ttpeer.toml"
    config.write_text("")
    assert main(["status", "--home", str(home), "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert f"""'ttpeer pool create --home "{home}" --config {config}'""" in err
    Home(tmp_path / "lab").create_pool("https://127.0.0.1:1", "sha256:" + "0" * 64, "alice", time.time())
    assert main(["status", "--home", str(tmp_path / "lab")]) == 1
    assert f"(start it with 'ttpeer up --home {tmp_path / 'lab'}')" in capsys.readouterr().err


def test_a_peer_still_preparing_is_not_said_to_train_nothing_for_want_of_a_link():
    from ttpeer._behind import behind_lines

    job = {"mode": "fused", "state": "running", "declined": None, "round": 9, "rounds": 20, "training_shard": None,
           "held_round": 8, "rounds_trained": 0, "rounds_looked_at": 3}
    assert any("trained none of the last 3 rounds" in line for line in behind_lines(job))
    preparing = {**job, "phase": "loading the task and its data, checking it fits"}
    assert not any("trained none" in line for line in behind_lines(preparing))


def test_a_full_disk_while_writing_tensorboard_events_is_one_warning_and_the_next_round_tries_again(
        tmp_path, caplog):
    import logging
    import os

    from ttpeer.daemon.service._board import Board
    from ttpeer.errors import DiskError

    board = Board.__new__(Board)  # only update()'s handling is under test: _update fails as a full disk does
    board.root, board._disabled = tmp_path, False
    calls = []

    def full() -> None:
        calls.append(1)
        raise DiskError(tmp_path / ".written", OSError(28, os.strerror(28)))

    board._update = full
    with caplog.at_level(logging.WARNING, logger="ttpeer.daemon"):
        board.update()
        board.update()
    assert len(calls) == 2 and not board._disabled  # it tries again at the next round
    assert all(r.exc_info is None for r in caplog.records), "a traceback in the log"
    assert "could not write TensorBoard events" in caplog.text and "the disk is full" in caplog.text
