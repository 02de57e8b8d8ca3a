"""``scripts/mutation``'s pure parts: which module a mutant belongs to, and the table's
counts and score (the run itself needs mutmut and minutes of CPU: not in CI)."""

from __future__ import annotations

import pytest

from bench.mutation import module_of, parse_args, table


def test_a_mutant_of_a_method_or_a_function_is_counted_under_its_module():
    assert module_of("ttpeer.proto._leases.xǁLeaseTableǁforget_before__mutmut_3") == "ttpeer.proto._leases"
    assert module_of("ttpeer.proto._outcome.x_took_part__mutmut_11") == "ttpeer.proto._outcome"
    assert module_of("ttpeer_wire._proofs.x_utc_text__mutmut_2") == "ttpeer_wire._proofs"


def test_the_score_is_killed_over_every_mutant_not_skipped():
    rows = table({"a.x_f__mutmut_1": "killed", "a.x_f__mutmut_2": "survived", "a.x_g__mutmut_1": "no tests",
                  "a.x_g__mutmut_2": "skipped", "b.xǁCǁm__mutmut_1": "killed"})
    a, b = rows
    assert (a["module"], a["mutants"], a["killed"], a["survived"], a["no tests"]) == ("a", 4, 1, 1, 1)
    assert a["score"] == pytest.approx(1 / 3) and b["score"] == 1.0


def test_modules_or_all_and_a_sane_job_count():
    assert parse_args(["--all"]).modules == ["ttpeer/proto/*.py", "ttpeer_wire/*.py"]
    assert parse_args([]).modules[0] == "ttpeer/proto/_leases.py"
    for bad in (["--all", "--modules", "x.py"], ["--jobs", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
