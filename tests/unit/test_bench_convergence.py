"""The pure parts of ``scripts/bench/convergence``: the variants it takes, the job each
runs, and the table it prints (the runs themselves are a benchmark; a short one is a slow
test, ``tests/integration/test_overlap_eager.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.convergence import Case, job_spec, parse_args, parse_variant, summary, with_bounds
from ttpeer.proto import outer_settings


def test_a_variant_names_overlap_or_wait_and_its_options():
    v = parse_variant("overlap", 25, 13)
    assert (v.overlap, v.h, v.sync, v.outer, v.default) == (True, 25, 13, None, True)
    assert parse_variant("wait", 25, 13).default is False  # what submit runs overlaps
    eager = parse_variant("overlap:sync=none,mu=0.5", 25, 13)
    assert (eager.sync, eager.outer, eager.default) == (None, (0.7, 0.5), False)
    longer = parse_variant("overlap:h=100", 25, 13)
    assert (longer.h, longer.sync) == (100, 34)  # a third of the round, as the cadence's margin allows
    for bad in ("ring", "overlap:lag=3", "wait:mu"):
        with pytest.raises(ValueError, match="variant|option"):
            parse_variant(bad, 25, 13)


def test_a_job_asks_the_pool_for_its_outer_step_unless_the_variant_fixes_one():
    case = Case("mnist1d", 4, 4, 0, parse_variant("overlap", 25, 13), 2e-3, 8, 1000, 1.0)
    spec = job_spec(case)
    assert (spec["overlap"], spec["outer_auto"], spec["shards"], spec["rounds"]) == (1, 2, 4, 40)  # as submit
    assert (spec["outer_lr"], spec["outer_momentum"]) == tuple(outer_settings(4, 25, None, agree=True))
    by_size = parse_variant("wait:agree=0", 25, 13)
    assert (by_size.agree, by_size.default, job_spec(replace(case, variant=by_size))["outer_auto"]) == (False, False, 1)
    assert by_size.settings(4, 0.9) == tuple(outer_settings(4, 25))  # the pool's size alone
    assert case.variant.settings(4, 0.9) == (0.7, 0.0)  # peers that agreed: no momentum
    fixed = job_spec(Case("mnist1d", 4, 4, 0, parse_variant("wait:mu=0.5", 25, 13), 2e-3, 8, 1000, 1.0))
    assert "outer_auto" not in fixed and fixed["outer_momentum"] == 0.5 and fixed["overlap"] == 0


def test_the_table_puts_each_variant_against_the_dp_bound_and_rounds_that_wait():
    def row(variant: str, seed: int, steps: float | None) -> dict:
        return {"task": "t", "batch": 4, "peers": 2, "seed": seed, "variant": variant, "default": variant == "overlap",
                "outer": None if variant == "dp" else [0.7, 0.5], "steps": steps}

    rows = [row("dp", 0, 100.0), row("dp", 1, 120.0), row("wait", 0, 110.0), row("wait", 1, 110.0),
            row("overlap", 0, 121.0), row("overlap", 1, 121.0), row("slow", 0, 300.0), row("slow", 1, None)]
    text = summary(rows)
    assert "| t | 4 | 2 | overlap (default) | 0.7, 0.5 | 121, 121 | 121 | 1.10x | 1.10x |" in text
    assert "| t | 4 | 2 | wait | 0.7, 0.5 | 110, 110 | 110 | 1.00x |  |" in text
    assert "| t | 4 | 2 | slow | 0.7, 0.5 | 300, not reached | not reached |  |  |" in text
    with_bounds(rows)
    assert [r["dp_steps"] for r in rows[2:4]] == [100.0, 120.0]


def test_the_arguments_need_a_target_or_an_ensemble(capsys):
    with pytest.raises(SystemExit):
        parse_args([])
    assert "--target" in capsys.readouterr().err
    args = parse_args(["--target", "1.0", "--peers", "2,8", "--variant", "wait:h=50"])
    assert args.peers == [2, 8] and [v.name for v in args.variants] == ["wait:h=50"]
    assert parse_args(["--ensemble", "4"]).ensemble == 4
