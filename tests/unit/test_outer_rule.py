"""The outer step picked by the pool (proto/_outer.py): the rule, and the records that
carry it (the job's ``outer_auto``, the close's ``outer_lr`` and ``outer_momentum``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ttpeer.proto import (
    Chain,
    JobSpec,
    Outer,
    Plan,
    RecordError,
    agreement,
    close_outer,
    outer_settings,
    round_outer,
    sign,
)
from ttpeer.proto._outer import AGREE_FULL, AGREE_NONE, LR, MOMENTUM_MAX, signal

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
    ({"outer_auto": 3}, "outer_auto"),
])
def test_a_job_with_inconsistent_outer_fields_is_refused(over, words):
    with pytest.raises(RecordError, match=words):
        sign("job", P.id, job_body(**over), M0)


def test_a_fused_job_may_ask_the_pool_for_its_outer_step():
    assert sign("job", P.id, job_body(outer_auto=1), M0)["outer_auto"] == 1
    by_size = JobSpec.of(sign("job", P.id, job_body(outer_auto=1), M0))
    agreeing = JobSpec.of(sign("job", P.id, job_body(outer_auto=2), M0))
    assert (by_size.outer_auto, by_size.outer_agree, agreeing.outer_auto, agreeing.outer_agree) == (
        True, False, True, True)


@given(st.integers(1, 4096), st.one_of(st.none(), st.floats(0, 4)))
def test_agreement_scales_the_momentum_between_none_and_the_pools(contributions, agreed):
    ceiling = outer_settings(contributions, 25)
    step = outer_settings(contributions, 25, agreed, agree=True)
    assert step.lr == ceiling.lr and 0.0 <= step.momentum <= ceiling.momentum
    assert round(step.momentum, 4) == step.momentum


def test_peers_that_agree_get_no_momentum_and_peers_that_do_not_get_the_pools():
    full = outer_settings(4, 25).momentum
    half = (AGREE_FULL + AGREE_NONE) / 2
    got = {a: outer_settings(4, 25, a, agree=True).momentum for a in (0.0, AGREE_NONE, half, AGREE_FULL, 0.9, 1.0)}
    assert got[0.0] == got[AGREE_NONE] == full  # pure noise, averaged
    assert got[AGREE_FULL] == got[0.9] == got[1.0] == 0.0  # the mean is about as long as a delta
    assert got[half] == round(full / 2, 4)
    assert list(got.values()) == sorted(got.values(), reverse=True)
    assert outer_settings(4, 25, None, agree=True).momentum == 0.0  # no round closed yet
    assert outer_settings(4, 25, 1.0).momentum == full  # a job by the pool's size alone ignores it


def _round(spread: list[float | None], mean_sq: float | None, samples: tuple[int, ...] = (64, 64)) -> tuple:
    from .proto_helpers import contrib

    job = sign("job", P.id, job_body(outer_auto=2, shards=len(spread)), M0)
    parts = []
    for i, (sq, n) in enumerate(zip(spread, samples, strict=True)):
        body = dict(contrib(P.id, key(f"outer-m{i}"), job, 0, job["init"], [i], samples=n).body)
        body["metrics"] = {} if sq is None else {"delta_sq": sq}
        parts.append(sign("contrib", P.id, body, key(f"outer-m{i}")))
    figures = {} if mean_sq is None else {"mean_sq": mean_sq}
    close = sign("close", P.id, close_body(job=job.id, base=job["init"], contribs=sorted(c.id for c in parts),
                                           **figures), M0)
    return job, parts, close


def test_agreement_reads_per_step_from_pure_noise_to_one_delta_whatever_the_pool_size():
    for n in (2, 4, 8, 64):
        assert (signal(1 / n, n, 25), signal(1.0, n, 25)) == (pytest.approx(0.0), pytest.approx(1.0))
    assert signal(0.3, 1, 25) == 1.0  # one trajectory: nothing was averaged away
    # Half signal, half noise over a round of 4 peers' deltas (S = N: the mean keeps 0.625) is
    # S/N = 1 over the round, 1/6 over one of its 6 steps: a seventh of a step's energy.
    assert signal(0.625, 4, 6) == pytest.approx(1 / 7)
    # The same agreement over a longer round is less signal per step.
    assert signal(0.625, 4, 25) < signal(0.625, 4, 6)


def test_agreement_is_the_means_energy_over_the_deltas_weighted_energy():
    _, parts, close = _round([2.0, 4.0], 1.5, samples=(100, 300))
    assert agreement(close, parts) == pytest.approx(1.5 / ((100 * 2.0 + 300 * 4.0) / 400))
    for spread, mean_sq in (([2.0, None], 1.5), ([2.0, 4.0], None), ([2.0, 0.0], 1.5), ([2.0, 4.0], 0.0)):
        _, parts, close = _round(spread, mean_sq)
        assert agreement(close, parts) is None, (spread, mean_sq)
    assert agreement(close, []) is None


def test_a_round_takes_the_agreement_of_the_close_before_it():
    job, parts, close = _round([1.0, 1.0], 0.99)  # 2 deltas that are nearly one: no momentum
    spec, by_id = JobSpec.of(job), {c.id: c for c in parts}
    chain = Chain((job["init"], close["state"]), (close,))
    plan = Plan.of(job, chain.closes)
    size = plan.inner_steps(1)
    assert round_outer(spec, 1, 2, plan, chain.closes, by_id).momentum == 0.0
    _, noisy_parts, noisy = _round([1.0, 1.0], 0.55)  # a twentieth of a step is signal: mostly noise
    assert round_outer(spec, 1, 2, plan, (noisy,), {c.id: c for c in noisy_parts}) == outer_settings(2, size)
    assert round_outer(spec, 0, 2, plan, (), by_id).momentum == 0.0  # the first round: none before it
    assert round_outer(spec, 1, 2, plan, chain.closes, {}).momentum == 0.0  # its contributions unknown here
    assert round_outer(spec, 1, 1, plan, chain.closes, by_id) == outer_settings(1, size)  # one: nothing averaged
    by_size = JobSpec.of(sign("job", P.id, job_body(outer_auto=1, shards=2), M0))
    assert round_outer(by_size, 1, 2, plan, chain.closes, by_id) == outer_settings(2, size)


def test_the_close_of_an_agreeing_job_names_its_means_energy_apart_from_its_eval_metrics():
    from ttpeer.proto import RecordSet
    from ttpeer.proto._closer import Closer

    job, parts, _ = _round([1.0, 1.0], None)
    records = RecordSet(P.id)
    for rec in [job, *parts]:
        records.add(rec)
    ids = tuple(sorted(c.id for c in parts))
    chain = Chain((job["init"],), ())
    body = Closer("me", 1.0).aggregated(JobSpec.of(job), 0, job["init"], ids, state("s1"),
                                        {"eval_loss": 2.0, "perplexity": 7.4, "mean_sq": 0.25}, records, chain)
    assert body["metrics"] == {"eval_loss": 2.0, "perplexity": 7.4} and body["mean_sq"] == 0.25
    assert sign("close", P.id, body, M0)["mean_sq"] == 0.25  # a close record may carry it


def test_the_close_names_the_step_its_aggregate_took():
    # The driver reports the step the state was made with (``Aggregated.outer``); the close
    # names that one, so peers that apply it reproduce the state. A report without one (an
    # older driver) gets the rule's step for the round, which is what the aggregate was given.
    from ttpeer.proto import RecordSet
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
