"""``scripts/bench/scaling``: the steps-to-loss arithmetic, and a short real run."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.scaling import main, steps_to


def test_steps_to_a_loss_interpolate_between_evaluations_and_never_extrapolate():
    curve = [(50, 2.0), (100, 1.0), (150, 1.2), (200, 0.5)]
    assert steps_to(curve, 1.5) == 75.0  # halfway from 2.0 at 50 to 1.0 at 100
    assert steps_to(curve, 1.0) == 100.0
    assert steps_to(curve, 2.5) == 50.0  # reached by the first evaluation: no earlier point
    assert steps_to(curve, 0.4) is None  # never reached
    assert steps_to(curve, 0.75) == 150 + (1.2 - 0.75) / (1.2 - 0.5) * 50  # the first time, after a rise


@pytest.mark.slow
def test_a_short_run_prints_both_batches_and_their_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["--task", "mnist1d:samples=4000", "--steps", "40", "--every", "10",
                 "--eval-samples", "500", "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| eval loss | steps at batch 64 | steps at batch 128 | ratio |" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 8
    for row in rows:  # each loss is one both runs reached: steps and a ratio, no "-"
        loss, one, two, ratio, best = (cell.strip() for cell in row.strip("|").split("|"))
        one_, two_ = float(one), float(two)
        assert one_ > 0 and two_ > 0  # the steps are printed rounded: so much slack, no more
        assert abs(float(ratio) - one_ / two_) <= (0.5 * one_ + 0.5 * two_) / two_**2 + 0.01
        assert abs(float(best.removesuffix("x")) * float(ratio) - 1) < 0.02
