"""The arithmetic of ``scripts/bench/wan``'s table: time to target, loss at equal
samples, and the targets' ratios (the lab runs themselves are a benchmark, not a test)."""

from __future__ import annotations

from bench.wan import Row, table


def _row(name: str, curve: list[tuple[float, int, float]], sent: list[int], util: float) -> Row:
    return Row(name, curve=curve, sent=sent, samples=curve[-1][1], wall=curve[-1][0], utilization=util)


def test_time_to_target_is_the_first_evaluation_at_or_below_it():
    row = _row("r", [(0.0, 0, 2.0), (1.0, 100, 1.5), (2.0, 200, 1.2), (3.0, 300, 1.4)], [0], 1.0)
    assert row.time_to(1.5) == 1.0 and row.time_to(1.3) == 2.0 and row.time_to(1.0) is None


def test_loss_at_equal_samples_interpolates_between_evaluations_and_never_extrapolates():
    row = _row("r", [(1.0, 100, 2.0), (2.0, 300, 1.0)], [0], 1.0)
    assert row.loss_at(200) == 1.5 and row.loss_at(300) == 1.0
    assert row.loss_at(50) is None and row.loss_at(400) is None


def test_table_reports_each_target_with_the_measured_ratio():
    ours = _row("ttpeer fused", [(2.0, 1000, 1.4), (4.0, 2000, 1.2)], [100, 300], 0.5)
    single = _row("one peer alone", [(0.0, 0, 2.3), (10.0, 2000, 1.25)], [0], 0.9)
    ddp = _row("gloo DDP", [(0.0, 0, 2.3), (40.0, 1000, 1.25), (80.0, 2000, 1.0)], [200_000, 200_000], 0.1)
    down = Row("hivemind DiLoCo", note="did not run: no reason")
    text, equal = table([single, ddp, ours, down], 1.3)
    assert equal == 2000
    assert "| hivemind DiLoCo | did not run: no reason |" in text
    assert "| ttpeer time to target / one peer's (<= 0.6, limit 0.5) | 0.40 | yes |" in text
    assert "| DDP time to target / ttpeer's (>= 20) | 10.00 | no |" in text
    assert "| DDP bytes per sample / ttpeer's (>= 1000) | 1000.00 | yes |" in text
    assert "| ttpeer eval loss / DDP's at 2000 samples (<= 1.02) | 1.20 | no |" in text
    assert "| ttpeer utilization (>= 97%) | 50.0% | no |" in text
