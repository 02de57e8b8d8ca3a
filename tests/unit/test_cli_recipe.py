"""The submit flags of precision, micro-batches, schedules and warm starts: the job
fields they become (none when unused, so such a job is the record it always was), and
bad input refused with what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from ttpeer._submit_cmd import recipe_fields as _recipe_fields
from ttpeer.cli import build_parser, main
from ttpeer.daemon import Home
from ttpeer.errors import JobError, UsageError


def _fields(home: Path, *flags: str) -> dict:
    args = build_parser().parse_args(["submit", "--task", "charlm", *flags])
    return _recipe_fields(args, Home(home))


def test_only_the_flags_given_become_job_fields(tmp_path):
    assert _fields(tmp_path) == {}
    assert _fields(tmp_path, "--precision", "bf16", "--micro-batch", "16", "--lr-schedule", "cosine",
                   "--warmup", "100", "--final-lr-ratio", "0.1", "--checkpointing") == {
        "precision": "bf16", "micro_batch": 16, "lr_schedule": "cosine", "warmup": 100, "final_lr_ratio": 0.1,
        "checkpointing": 1}
    assert _fields(tmp_path, "--outer-lr-schedule", "linear", "--outer-warmup", "2",
                   "--outer-final-lr-ratio", "0.3") == {
        "outer_lr_schedule": "linear", "outer_warmup": 2, "outer_final_lr_ratio": 0.3}


def test_init_takes_a_file_or_a_finished_job_of_this_home(tmp_path):
    model = tmp_path / "pretrained.safetensors"
    model.write_bytes(b"x")
    assert _fields(tmp_path, "--init", str(model)) == {"init": str(model.absolute())}
    job = tmp_path / "states" / ("ab12" + "0" * 60)
    job.mkdir(parents=True)
    with pytest.raises(JobError, match="job 'ab12' has not finished on this peer .* --init needs its final model"):
        _fields(tmp_path, "--init", "ab12")
    (job / "done.json").write_text("{}")
    assert _fields(tmp_path, "--init", "AB12") == {"init": str(job / "final.safetensors")}


@pytest.mark.parametrize(("flags", "error"), [
    (["--init", "model.pt"], "--init model.pt: no such file, and not a job id"),
    (["--micro-batch", "65"], "--micro-batch (65) must not exceed the batch size (64)"),
])
def test_bad_recipe_flags_are_clear_errors(tmp_path, flags, error):
    with pytest.raises(UsageError) as exc:
        _fields(tmp_path, *flags)
    assert error in str(exc.value)


def test_an_unknown_precision_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["submit", "--task", "charlm", "--precision", "fp8", "--home", str(tmp_path)])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
