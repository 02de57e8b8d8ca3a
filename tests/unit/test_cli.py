"""The command line: help that helps, and clear errors that lose nothing."""

from __future__ import annotations

import time

import pytest

from ttpeer.cli import main
from ttpeer.daemon import Home


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("relay", "pool", "invite", "join", "up", "submit", "status", "wait", "export", "demo"):
        assert cmd in out


def test_malformed_token_is_refused_without_echoing_it(tmp_path, capsys):
    token = "ttp1.not-a-real-token-SECRETSECRET"
    assert main(["join", token, "--home", str(tmp_path / "h")]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "damaged" in err and "SECRETSECRET" not in err
    assert not (tmp_path / "h").exists()  # nothing was created


def _enrolled(path):
    return Home(path).create_pool("https://127.0.0.1:1", "sha256:" + "0" * 64, "alice", time.time())


def test_status_without_a_daemon_says_how_to_start_one(tmp_path, capsys):
    _enrolled(tmp_path)
    assert main(["status", "--home", str(tmp_path)]) == 1
    assert "ttpeer up" in capsys.readouterr().err


def test_status_on_a_home_that_is_not_enrolled_says_to_enroll_it(tmp_path, capsys):
    assert main(["status", "--home", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "not enrolled" in err and "ttpeer up" not in err


def test_export_of_an_unknown_job_says_there_is_no_such_job(tmp_path, capsys):
    _enrolled(tmp_path)
    assert main(["export", "deadbeef", str(tmp_path / "m.safetensors"), "--home", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no job 'deadbeef'" in err and "has not finished" not in err


def test_export_of_a_job_still_finishing_is_the_same_clear_error(tmp_path, capsys):
    # The final model is written before its sidecar and done.json: caught in between, export
    # says the job has not finished, rather than failing on the missing sidecar.
    folder = tmp_path / "states" / "abc123"
    folder.mkdir(parents=True)
    (folder / "final.safetensors").write_bytes(b"weights")
    out = tmp_path / "m.safetensors"
    assert main(["export", "abc123", str(out), "--home", str(tmp_path)]) == 1
    assert "has not finished" in capsys.readouterr().err and not out.exists()


def test_bad_flag_values_are_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["submit", "--task", "mnist1d", "--rounds", "0", "--home", str(tmp_path)])
    assert exc.value.code == 2
    assert "at least 1" in capsys.readouterr().err


def test_pool_create_checks_the_fingerprint_format(tmp_path, capsys):
    assert main(["pool", "create", "--relay", "https://127.0.0.1:1", "--fingerprint", "abc",
                 "--home", str(tmp_path / "h")]) == 1
    assert "sha256:" in capsys.readouterr().err


def test_submit_names_the_built_in_tasks_for_an_unknown_one(tmp_path, capsys):
    assert main(["submit", "--task", "charm", "--home", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "unknown task 'charm'" in err and "'charlm'" in err and "'mnist1d'" in err
    # A charlm size gets past the check (and on to the daemon, which is not running here).
    assert main(["submit", "--task", "charlm:n_layer=4", "--home", str(tmp_path)]) == 1
    assert "unknown task" not in capsys.readouterr().err


def test_fused_jobs_default_to_auto_rounds_overlapped_with_the_pools_outer_step():
    # scripts/bench/convergence: the outer step that suits a round depends on how many peers
    # contributed and how far their deltas agreed, so by default each close picks it (outer_auto
    # 2); a flag fixes it for every round.
    from ttpeer._submit_cmd import cadence_defaults as _cadence_defaults
    from ttpeer._submit_cmd import outer_fields as _outer_fields
    from ttpeer.cli import build_parser
    from ttpeer.errors import UsageError

    def defaults(*extra: str) -> tuple:
        args = build_parser().parse_args(["submit", "--task", "mnist1d", *extra])
        overlap = _cadence_defaults(args)
        return overlap, args.inner_steps, _outer_fields(args)

    overlap, steps, outer = defaults()
    assert (overlap, steps, outer["outer_auto"], outer["outer_momentum"]) == (True, (5, 1000), 2, 0.0)
    assert defaults("--no-overlap")[0] is False and defaults("--no-overlap")[2]["outer_auto"] == 2
    assert defaults("--inner-steps", "40", "--outer-momentum", "0.5") == (
        True, 40, {"outer_lr": 0.7, "outer_momentum": 0.5})
    assert defaults("--outer-lr", "1.0")[2] == {"outer_lr": 1.0, "outer_momentum": 0.7}
    assert "outer_auto" not in defaults("--outer-lr-schedule", "cosine")[2]  # a schedule is the user's own
    assert defaults("--mode", "ensemble", "--members", "2")[:2] == (False, 25)
    assert "outer_auto" not in defaults("--mode", "ensemble", "--members", "2")[2]
    for wrong in (["--overlap"], ["--inner-steps", "auto"], ["--outer-lr", "0.5"]):
        with pytest.raises(UsageError, match="fused"):
            defaults("--mode", "ensemble", "--members", "2", *wrong)
    with pytest.raises(UsageError, match="Nesterov momentum: from 0 to less than 1, got 1.5"):
        defaults("--outer-momentum", "1.5")
    with pytest.raises(UsageError, match="--outer-lr must be more than 0"):
        defaults("--outer-lr", "0")


def test_step_timeout_takes_seconds_or_a_duration_and_is_checked(tmp_path, capsys):
    from ttpeer.cli import build_parser

    def timeout(*extra: str) -> float:
        return build_parser().parse_args(["submit", "--task", "mnist1d", *extra]).step_timeout

    assert timeout() == 600.0 and timeout("--step-timeout", "90") == 90.0 and timeout("--step-timeout", "10m") == 600.0
    # Checked before the daemon is asked (none runs here): the message says what fits.
    assert main(["submit", "--task", "mnist1d", "--step-timeout", "0", "--home", str(tmp_path)]) == 1
    assert "--step-timeout must be between 1 s and 7 days, got 0 s" in capsys.readouterr().err
    assert main(["submit", "--task", "mnist1d", "--step-timeout", "8d", "--home", str(tmp_path)]) == 1
    assert "--step-timeout must be between" in capsys.readouterr().err


def test_fused_jobs_slice_by_default_and_no_slices_turns_it_off():
    # scripts/bench/exchange: slices were faster from 4 peers up, with equal links and with
    # one slow one; two peers close from all deltas whatever the job says (the proto's rule).
    # scripts/bench/requantize: 3-bit reduced slices cost no loss, so they are the default.
    from ttpeer._parser import DEFAULT_CHUNK, DEFAULT_SLICE_MIN
    from ttpeer._submit_cmd import slices_fields as _slices_fields
    from ttpeer.cli import build_parser
    from ttpeer.errors import UsageError

    def fields(*extra: str) -> dict[str, int]:
        return _slices_fields(build_parser().parse_args(["submit", "--task", "charlm", *extra]))

    # By default a round slices only where that saves each peer 1 MiB (a small model's
    # rounds close from all deltas); --slices slices wherever it can.
    assert fields() == {"chunk": DEFAULT_CHUNK, "slice_bits": 3, "slice_min": DEFAULT_SLICE_MIN}
    assert fields("--slices") == {"chunk": DEFAULT_CHUNK, "slice_bits": 3}
    assert fields("--slices", "8192", "--slice-bits", "8") == {"chunk": 8192, "slice_bits": 8}
    assert fields("--no-slices") == {}
    assert fields("--mode", "ensemble", "--members", "2") == {}
    with pytest.raises(UsageError, match="pick one"):
        fields("--slices", "--no-slices")
    with pytest.raises(UsageError, match="--slice-bits goes with slices"):
        fields("--no-slices", "--slice-bits", "8")
    with pytest.raises(UsageError, match="--slices goes with a fused job"):
        fields("--mode", "ensemble", "--members", "2", "--slices")
    with pytest.raises(UsageError, match="--slice-bits goes with a fused job"):
        fields("--mode", "ensemble", "--members", "2", "--slice-bits", "4")
