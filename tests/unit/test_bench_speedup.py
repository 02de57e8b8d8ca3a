"""The arithmetic and the arguments of ``scripts/bench/speedup``: budgets, the DP bound's
ratios, the table and its targets (the lab runs themselves are a benchmark, not a test)."""

from __future__ import annotations

import argparse

import pytest

from bench.speedup import (
    Result,
    bound_ratios,
    budget_rounds,
    emulation,
    outer_fields,
    parse_args,
    parse_bound,
    slice_fields,
    table,
)
from bench.wan import Row, round_sizes
from ttpeer._parser import DEFAULT_CHUNK, DEFAULT_SLICE_BITS, DEFAULT_SLICE_MIN


def _row(name: str, curve: list[tuple[float, int, float]], util: float | None = None,
         rounds: list[int] | None = None) -> Row:
    return Row(name, curve=curve, sent=[1000, 3000], samples=curve[-1][1], wall=curve[-1][0], utilization=util,
               rounds=rounds or [], step_s=0.05)


def test_the_defaults_and_quick_pick_target_margin_and_rows():
    args = parse_args([])
    assert (args.batch, args.target, args.margin) == (4, 1.0, 2.0)
    assert args.rows == ["single", "ttpeer-2", "ttpeer-4", "ttpeer-8"] and args.bound is None
    # Compute is a fixed step, as on a GPU, unless a slowdown is asked for (not both).
    assert (args.step_ms, args.slowdown) == (100.0, None) and emulation(args) == ("--step-s", "0.1")
    assert emulation(parse_args(["--slowdown", "8"])) == ("--slowdown", "8")
    assert parse_args(["--step-ms", "300"]).step_ms == 300.0
    quick = parse_args(["--quick"])
    assert (quick.target, quick.margin) == (1.2, 1.6) and "ttpeer-4-fixed" not in quick.rows
    assert parse_args(["--quick", "--rows", "single,ttpeer-4-fixed"]).rows == ["single", "ttpeer-4-fixed"]
    # The job is what submit runs: the pool's outer step, unless one is fixed, and submit's
    # slices (the all-deltas row leaves them out).
    assert outer_fields(args)["outer_auto"] == 2  # as submit sends
    assert slice_fields() == {"chunk": DEFAULT_CHUNK, "slice_bits": DEFAULT_SLICE_BITS, "slice_min": DEFAULT_SLICE_MIN}
    assert parse_args(["--rows", "ttpeer-4-all,single,ttpeer-4"]).rows == ["single", "ttpeer-4", "ttpeer-4-all"]
    assert outer_fields(parse_args(["--outer-momentum", "0.5"])) == {"outer_lr": 0.7, "outer_momentum": 0.5}
    assert parse_args(["--target", "0.7", "--bound", "2=0.5,4=0.3"]).bound == {2: 0.5, 4: 0.3}


@pytest.mark.parametrize("argv", [["--rows", "single,nope"], ["--rows", "ttpeer-2"], ["--h-min", "30", "--h-max", "20"],
                                  ["--bound", "2=1.5"], ["--step-ms", "100", "--slowdown", "8"]])
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_parse_bound_reads_pairs_and_refuses_others():
    assert parse_bound("2=0.52,4=0.29") == {2: 0.52, 4: 0.29}
    for bad in ("2", "x=0.5", "1=0.5", "2=0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bound(bad)


def test_budgets_and_bound_ratios():
    assert budget_rounds(1000, 1.4) == 56  # 1400 inner steps per shard in units of 25
    assert budget_rounds(1, 0.1) == 1
    assert bound_ratios({1: 3000.0, 2: 1560.0, 4: 870.0}) == {2: 0.52, 4: 0.29}
    assert bound_ratios({1: None, 2: 1560.0}) == {} and bound_ratios({1: 3000.0, 4: None}) == {}


def test_round_sizes_carry_a_size_forward_and_stop_at_the_budget():
    assert round_sizes({0: 25, 1: 25, 2: 40}, 5, 25, 150) == [25, 25, 40, 40, 20]
    assert round_sizes({}, 3, 25, 1000) == [25, 25, 25]
    assert round_sizes({0: 25, 3: 10}, 5, 25, 1000) == [25, 25, 25, 10, 10]


def test_table_puts_each_row_against_one_peer_and_the_dp_bound_and_says_which_targets_are_met():
    single = _row("1 peer (plain loop)", [(0.0, 0, 2.3), (50.0, 8000, 1.0), (100.0, 16000, 0.89)], 0.99)
    two = _row("2 peers, auto", [(10.0, 4000, 1.5), (55.0, 16000, 0.9)], 0.98, [25] * 24)
    four = _row("4 peers, auto", [(20.0, 16000, 0.95), (40.0, 32000, 0.85)], 0.95, [25] * 30)
    fixed = _row("4 peers, fixed H=25", [(30.0, 16000, 0.95), (45.0, 32000, 0.88)], 0.9, [25] * 30)
    down = Row("ttpeer 1", note="did not run: no reason")
    bounds = {2: 0.5, 4: 0.3}
    text = table(single, [Result(2, two, auto=True), Result(4, four, auto=True), Result(4, fixed), Result(1, down)],
                 bounds, 0.9)
    assert "| 1 peer (plain loop) | 1 | 100.0 s | 1 | n/a | n/a | - | 99.0% | 0.00 MB | 0.2 | 50.0 ms | 0.8900 |" \
        in text
    assert "| 2 peers, auto | 2 | 55.0 s | 0.55x | 0.50x | 1.10x | 24 (25, 25, 25, 25, ..., 25, 25, 25) | 98.0% |" \
        in text
    assert "| 4 peers, fixed H=25 | 4 | 45.0 s | 0.45x | 0.30x | 1.50x |" in text
    assert "| ttpeer 1 | 1 | did not run: no reason |" in text
    assert "| (the task) DP bound, 2 peers (<= 0.51x) | 0.50x | yes |" in text
    assert "| (the task) DP bound, 4 peers (<= 0.29x) | n/a | no |" not in text
    assert "| (the task) DP bound, 4 peers (<= 0.29x) | 0.30x | no |" in text
    assert "| 2 peers, auto: time to target / one peer's (<= 0.58x) | 0.55x | yes |" in text
    assert "| 2 peers, auto: time to target / the DP bound's (<= 1.15x) | 1.10x | yes |" in text
    assert "| 2 peers, auto: utilization over 24 rounds (>= 95% over >= 20) | 98.0% | yes |" in text
    assert "| 4 peers, auto: time to target / one peer's (<= 0.33x) | 0.40x | no |" in text
    assert "| 4 peers, auto: time to target / the DP bound's (<= 1.15x) | 1.33x | no |" in text
    assert "| 4 peers, auto: utilization over 30 rounds (>= 95% over >= 20) | 95.0% | yes |" in text
    assert "fixed H=25: time" not in text  # the targets are the auto rows'


def test_a_row_that_never_reaches_the_target_says_where_it_ended():
    single = _row("1 peer (plain loop)", [(0.0, 0, 2.3), (50.0, 8000, 0.8)])
    slow = _row("2 peers, auto", [(10.0, 4000, 1.5), (60.0, 16000, 1.1)], 0.9, [25] * 10)
    text = table(single, [Result(2, slow, auto=True)], {2: 0.5}, 0.9)
    assert "| 2 peers, auto | 2 | not reached in 60 s (at 1.100) | n/a |" in text
    assert "| 2 peers, auto: time to target / one peer's (<= 0.58x) | n/a | no |" in text
