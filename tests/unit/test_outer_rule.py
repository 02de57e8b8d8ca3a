"""The outer step picked by the pool (proto/_outer.py): the rule, and the records that
carry it (the job's ``outer_auto``, the close's ``outer_lr`` and ``outer_momentum``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ttpeer.proto import Outer, RecordError, close_outer, outer_settings, sign
from ttpeer.proto._outer import LR, MOMENTUM_MAX

from .proto_helpers import Pool, hex64, job_body, key, state

P = Pool("outer")
M0 = key("outer-m0")


@given(st.integers(1, 4096), st.integers(1, 1_000_000))
def test_the_rule_gives_an_outer_step_within_bounds(contributions, batches):
    step = outer_settings(contributions, batches)
    assert isinstance(step, Outer) and step.lr == LR
    assert 0.0 <= step.momentum <= MOMENTUM_MAX
    assert round(step.momentum, 4) == step.momentum  # as a record holds it


def test_more_contributions_never_lower_the_momentum():
    got = [outer_settings(n, 25).momentum for n in range(1, 64)]
    assert got == sorted(got)
    # One contribution is one peer's trajectory: about plain local training (lr / (1 - mu) ~ 1).
    one = outer_settings(1, 25)
    assert 0.8 <= one.lr / (1 - one.momentum) <= 1.2
    assert outer_settings(4, 25).momentum > outer_settings(2, 25).momentum
    assert outer_settings(0, 25) == outer_settings(1, 25)  # no contribution is not fewer than one


def close_body(**over: object) -> dict:
    body = {"job": hex64("job"), "round": 0, "base": state("a"), "contribs": [hex64("c")], "state": state("b"),
            "metrics": {}}
    body.update(over)
    return body


def test_a_close_names_its_outer_step_and_peers_read_it_back():
    rec = sign("close", P.id, close_body(outer_lr=0.7, outer_momentum=0.6852), M0)
    assert close_outer(rec) == Outer(0.7, 0.6852)
    assert close_outer(sign("close", P.id, close_body(), M0)) is None  # the job's own step


@pytest.mark.parametrize(("over", "words"), [
    ({"outer_lr": 0.7}, "both outer_lr and outer_momentum"),
    ({"outer_momentum": 0.5}, "both outer_lr and outer_momentum"),
    ({"outer_lr": 0.7, "outer_momentum": 1.5}, "outer_momentum"),
])
def test_a_close_with_half_an_outer_step_is_refused(over, words):
    with pytest.raises(RecordError, match=words):
        sign("close", P.id, close_body(**over), M0)


@pytest.mark.parametrize(("over", "words"), [
    ({"outer_auto": 1, "mode": "ensemble", "members": [{"seed": 1, "lr": 0.001, "weight_decay": 0.0}],
      "shards": 1}, "only a fused job has an outer step"),
    ({"outer_auto": 1, "outer_lr_schedule": "cosine"}, "outer-lr schedule"),
    ({"outer_auto": 2}, "outer_auto"),
])
def test_a_job_with_inconsistent_outer_fields_is_refused(over, words):
    with pytest.raises(RecordError, match=words):
        sign("job", P.id, job_body(**over), M0)


def test_a_fused_job_may_ask_the_pool_for_its_outer_step():
    assert sign("job", P.id, job_body(outer_auto=1), M0)["outer_auto"] == 1


def test_the_close_names_the_step_its_aggregate_took():
    # The driver reports the step the state was made with (``Aggregated.outer``); the close
    # names that one, so peers that apply it reproduce the state. A report without one (an
    # older driver) gets the rule's step for the round, which is what the aggregate was given.
    from ttpeer.proto import Chain, JobSpec, RecordSet
    from ttpeer.proto._closer import Closer

    from .proto_helpers import contrib

    job = sign("job", P.id, job_body(outer_auto=1, shards=2), M0)
    parts = [contrib(P.id, M0, job, 0, job["init"], [0]), contrib(P.id, key("outer-m1"), job, 0, job["init"], [1])]
    records = RecordSet(P.id)
    for rec in [job, *parts]:
        records.add(rec)
    ids = tuple(sorted(c.id for c in parts))
    closer = Closer("me", 1.0)
    given = closer.aggregated(JobSpec.of(job), 0, job["init"], ids, state("s1"), {}, records,
                              Chain((job["init"],), ()), outer=Outer(0.7, 0.42))
    assert (given["outer_lr"], given["outer_momentum"]) == (0.7, 0.42)
    ruled = closer.aggregated(JobSpec.of(job), 0, job["init"], ids, state("s1"), {}, records,
                              Chain((job["init"],), ()))
    assert (ruled["outer_lr"], ruled["outer_momentum"]) == tuple(outer_settings(2, job["batches"]))
    fixed = sign("job", P.id, job_body(shards=2), M0)
    assert "outer_lr" not in closer.aggregated(JobSpec.of(fixed), 0, fixed["init"], ids, state("s1"), {}, records,
                                               Chain((fixed["init"],), ()), outer=Outer(0.7, 0.42))
