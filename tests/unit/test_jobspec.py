"""A job record read once (``proto/_jobspec.py``): every field a part reads comes from the
record as signed, optional ones at the defaults the schema documents; and the job's
``Mode``, whose rules are each read by the part that decides by them."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from ttpeer.proto import ENSEMBLE, FUSED, JobSpec, RecordError, mode_named, sign

from .proto_helpers import Pool, hex64, job_body, key

POOL = Pool("jobspec")
AUTHOR = key("jobspec-author")
ROOT = Path(__file__).resolve().parents[2] / "ttpeer"


def _spec(**over: object) -> JobSpec:
    return JobSpec.of(sign("job", POOL.id, job_body(**over), AUTHOR))


def test_a_fused_record_reads_into_its_fields_and_the_defaults_of_what_it_leaves_out():
    job = _spec()
    assert (job.mode, job.rounds, job.shards, job.inner_steps, job.batch_size) == (FUSED, 3, 4, 2, 8)
    assert (job.task, job.task_blob, job.seed, job.inner_lr, job.outer_momentum) == ("builtin:linear", "", 1, 0.001,
                                                                                      0.9)
    assert job.init == job.record["init"] and job.body is job.record.body
    assert (job.overlap, job.auto, job.chunk, job.slice_bits, job.slow_links, job.outer_auto) == (
        False, False, None, 8, False, False)
    assert (job.step_timeout, job.data, job.micro_batch, job.checkpointing, job.holdout) == (None, None, None, False, 0)
    assert (dict(job.datasets), dict(job.samples), job.members, job.params, job.trainable) == ({}, {}, (), None, None)


def test_the_optional_fields_are_read_as_given():
    ids = {"corpus": hex64("corpus")}
    job = _spec(overlap=1, h_min=2, h_max=50, chunk=8192, slice_bits=3, outer_auto=1, step_timeout=90,
                data=hex64("data"), micro_batch=4, checkpointing=1, datasets=ids, samples=ids,
                params=1000, trainable=10)
    assert (job.overlap, job.auto, job.h_min, job.h_max, job.chunk, job.slice_bits) == (True, True, 2, 50, 8192, 3)
    assert (job.slow_links, job.outer_auto, job.step_timeout, job.micro_batch, job.checkpointing) == (
        True, True, 90, 4, True)
    assert (job.data, dict(job.datasets), dict(job.samples), job.params, job.trainable) == (
        hex64("data"), ids, ids, 1000, 10)


def test_an_ensemble_record_lists_its_members_and_holdout():
    members = [{"seed": 5, "lr": 0.001, "weight_decay": 0.01}, {"seed": 6, "lr": 0.002, "weight_decay": 0.0}]
    job = _spec(mode="ensemble", shards=2, members=members, holdout=64)
    assert job.mode is ENSEMBLE and [dict(m) for m in job.members] == members and job.holdout == 64


def test_a_spec_is_hashable_and_equal_to_the_same_records_spec():
    rec = sign("job", POOL.id, job_body(), AUTHOR)
    assert JobSpec.of(rec) == JobSpec.of(rec) and len({JobSpec.of(rec), JobSpec.of(rec)}) == 1
    assert JobSpec.of(rec) != _spec(seed=2)


def test_a_record_of_another_kind_or_a_mode_that_is_none_is_refused():
    with pytest.raises(RecordError, match="a cancel record is not a job"):
        JobSpec.of(sign("cancel", POOL.id, {"job": hex64("j"), "at": 1}, AUTHOR))
    with pytest.raises(RecordError, match="mode must be one of fused, ensemble, got 'fusion'"):
        mode_named("fusion")


def test_the_modes_rules_differ_where_the_protocol_does():
    differ = {f.name for f in dataclasses.fields(FUSED) if getattr(FUSED, f.name) != getattr(ENSEMBLE, f.name)}
    assert differ == {f.name for f in dataclasses.fields(FUSED)}  # else a rule is no rule
    assert repr(FUSED) == "Mode('fused')"


def test_every_rule_of_a_mode_is_read_by_the_part_it_decides():
    """A rule no code reads is a flag that decides nothing: each is read as ``.mode.<rule>``
    somewhere in ttpeer/ outside the module that defines it."""
    source = "\n".join(p.read_text() for p in ROOT.rglob("*.py") if p.name != "_jobspec.py")
    unread = [f.name for f in dataclasses.fields(FUSED) if f.name != "name"
              and not re.search(rf"\bmode\.{f.name}\b", source)]
    assert unread == []


@pytest.mark.parametrize(("spec", "problem"), [
    ({"mode": "fused", "members": 3}, "--members goes with --mode ensemble"),
    ({"mode": "ensemble", "members": 0}, "between 1 and 4096, got 0"),
    ({"mode": "ensemble", "members": True}, "between 1 and 4096, got True"),
    ({"mode": "ensemble", "members": 3, "shards": 2}, "one shard per member"),
    ({"mode": "ensemble", "members": 3, "init": "/m.safetensors"}, "an ensemble's members start fresh"),
])
def test_a_mode_names_what_is_wrong_with_a_submitted_spec(spec, problem):
    found = mode_named(spec["mode"]).problem(spec)
    assert found is not None and problem in found


def test_a_mode_completes_a_spec_it_accepts():
    spec = {"mode": "ensemble", "members": 3, "shards": None, "seed": 7, "inner_lr": 1e-3, "weight_decay": 0.01}
    assert ENSEMBLE.problem(spec) is None
    out = ENSEMBLE.complete(spec)
    assert out["shards"] == 3 and len(out["members"]) == 3 and len({m["seed"] for m in out["members"]}) == 3
    assert FUSED.problem({"mode": "fused", "members": None}) is None
    assert "members" not in FUSED.complete({"mode": "fused", "members": None, "seed": 1})
