"""How a peer runs inner steps: micro-batches accumulate to the full batch's gradient,
autocast covers forward/backward only, the lr follows the job's schedule, and the fit
check picks a micro-batch rather than declining."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ttpeer.proto import RecordError, sign
from ttpeer.train import (
    InnerTrainer,
    LrSchedule,
    Recipe,
    TaskError,
    _inner,
    fit_batch,
    init_state,
    load_task,
    memory_need,
    shard_indices,
)
from ttpeer.train._recipe import split

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def linear():
    return load_task(str(Path(__file__).parent / "fixtures" / "task_linear.py"), Path("/nonexistent"))


@pytest.fixture(scope="module")
def charlm():
    return load_task("charlm:n_layer=2,d_model=32,block_size=16", Path("/nonexistent"))


def _grads_after_one_step(task, recipe: Recipe, batch: list[int]) -> dict[str, torch.Tensor]:
    trainer = InnerTrainer(task, seed=1, recipe=recipe)
    trainer.start(init_state(task, 7))
    trainer.train_shard([batch])
    # The step leaves the (clipped) accumulated gradient in .grad.
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("task_name", ["linear", "charlm"])
def test_four_micro_batches_of_16_give_the_gradient_of_one_batch_of_64(task_name, request, monkeypatch):
    task = request.getfixturevalue(task_name)
    # Unclipped: clipping to norm 1 would hide a gradient off by a constant factor.
    monkeypatch.setattr(_inner, "GRAD_CLIP", math.inf)
    batch = shard_indices(task.n_train, 0, 0, 0, 1, 1, 64)[0]
    whole = _grads_after_one_step(task, Recipe(), batch)
    parts = _grads_after_one_step(task, Recipe(micro_batch=16), batch)
    for name, grad in whole.items():
        torch.testing.assert_close(parts[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_micro_batches_split_as_evenly_as_they_can():
    assert split(64, None) == [64] and split(64, 64) == [64] and split(64, 100) == [64]
    assert split(64, 16) == [16, 16, 16, 16]
    assert split(10, 4) == [4, 3, 3] and sum(split(1000, 7)) == 1000 and max(split(1000, 7)) <= 7


@pytest.mark.slow
def test_activation_checkpointing_keeps_the_gradient_and_needs_less_memory(charlm):
    batch = shard_indices(charlm.n_train, 0, 0, 0, 1, 1, 32)[0]
    plain = _grads_after_one_step(charlm, Recipe(), batch)
    ckpt = _grads_after_one_step(charlm, Recipe(checkpointing=True), batch)
    for name, grad in plain.items():
        torch.testing.assert_close(ckpt[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    full = memory_need(charlm, batch_size=32, shards=2)
    less = memory_need(charlm, batch_size=32, shards=2, checkpointing=True)
    assert less.activations < full.activations / 2


def test_a_model_without_checkpointing_says_so(linear):
    with pytest.raises(TaskError, match="no gradient_checkpointing_enable"):
        InnerTrainer(linear, recipe=Recipe(checkpointing=True))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_trains_fp32_weights_and_optimizer(charlm, precision):
    trainer = InnerTrainer(charlm, lr=3e-3, seed=0, recipe=Recipe(precision=precision))
    state = init_state(charlm, 0)
    trainer.start(state)
    before, _ = trainer.evaluate(state.params)
    seen = set()
    trainer.model.head.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
    trainer.train_shard(shard_indices(charlm.n_train, 0, 0, 0, 1, 30, 32))
    assert seen == {torch.bfloat16 if precision == "bf16" else torch.float16}  # the forward ran in it
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in trainer.model.parameters())
    moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)
    assert all(t.dtype == torch.float32 for t in trainer.delta(state).values())
    after, _ = trainer.evaluate({n: state.params[n] - d for n, d in trainer.delta(state).items()})
    assert after < before - 0.2
    # fp16 goes through a gradient scaler, bf16 (fp32's exponent range) does not.
    assert (trainer._scaler is not None) == (precision == "fp16")


@pytest.mark.slow
def test_the_lr_of_a_step_is_the_schedules_at_its_global_step(linear):
    schedule = LrSchedule("cosine", warmup=3, total=40, final_ratio=0.1)
    trainer = InnerTrainer(linear, lr=0.01, recipe=Recipe(schedule=schedule))
    seen: list[float] = []
    trainer.optimizer.register_step_pre_hook(lambda opt, *_: seen.append(opt.param_groups[0]["lr"]))
    trainer.start(init_state(linear, 0))
    trainer.train_shard(shard_indices(linear.n_train, 0, 2, 0, 1, 5, 16), first_step=10)
    assert seen == [0.01 * schedule.factor(s) for s in range(10, 15)]


def test_schedules_warm_up_then_decay_to_the_final_ratio():
    cos = LrSchedule("cosine", warmup=10, total=110, final_ratio=0.1)
    lin = LrSchedule("linear", warmup=10, total=110, final_ratio=0.0)
    const = LrSchedule("constant", warmup=4, total=10)
    assert [cos.factor(s) for s in (0, 4, 9)] == pytest.approx([1 / 11, 5 / 11, 10 / 11])
    assert cos.factor(10) == lin.factor(10) == 1.0
    assert cos.factor(60) == pytest.approx(0.55) and lin.factor(60) == pytest.approx(0.5)
    assert cos.factor(109) == pytest.approx(0.1, abs=1e-3) and lin.factor(109) == pytest.approx(0.01)
    assert [const.factor(s) for s in (0, 3, 4, 9)] == [0.2, 0.8, 1.0, 1.0]
    assert all(0 < cos.factor(s) <= 1 for s in range(110))
    assert LrSchedule.of_job({"rounds": 5, "batches": 8}) == LrSchedule("constant", 0, 40, 0.0)
    assert math.isclose(LrSchedule.of_job({"rounds": 5, "batches": 8, "lr_schedule": "linear",
                                           "final_lr_ratio": 0.5}).factor(39), 1 - 0.5 * 39 / 40)


@pytest.mark.parametrize(("fields", "error"), [
    ({"warmup": 40}, "--warmup (40 steps) must be shorter than the job, which has 40 inner steps"),
    ({"final_lr_ratio": 1.5}, "--final-lr-ratio must be between 0 and 1"),
    ({"lr_schedule": "step"}, "unknown lr schedule 'step'"),
])
def test_a_bad_schedule_is_refused_with_what_to_change(fields, error):
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")):
        LrSchedule.of_job({"rounds": 5, "batches": 8, **fields})


def _pool_and_job(tmp_path):
    """A home with a pool, and the body of a valid fused job to sign in it."""
    from ttpeer.daemon import Home

    home = Home(tmp_path / "a")
    cfg = home.create_pool("https://relay.test.invalid", "sha256:" + "0" * 64, "a", 0)
    body = {"task": "mnist1d", "task_hash": "0" * 64, "task_blob": "", "mode": "fused", "rounds": 5, "shards": 2,
            "batches": 8, "batch_size": 64, "inner_lr": 1e-3, "weight_decay": 0.0, "outer_lr": 0.7,
            "outer_momentum": 0.9, "bits": 8, "seed": 0, "init": "sha256:" + "0" * 64, "init_blob": "0" * 64,
            "lease": 30.0, "steal": True, "at": 0}
    return home, cfg, body


def test_a_job_record_with_a_warmup_past_its_end_or_a_micro_batch_over_its_batch_is_invalid(tmp_path):
    home, cfg, body = _pool_and_job(tmp_path)
    sign("job", cfg.pool, {**body, "warmup": 39, "micro_batch": 64, "precision": "bf16"}, home.node_key())
    with pytest.raises(RecordError, match="warmup"):
        sign("job", cfg.pool, {**body, "warmup": 40}, home.node_key())
    with pytest.raises(RecordError, match="micro_batch"):
        sign("job", cfg.pool, {**body, "micro_batch": 65}, home.node_key())
    with pytest.raises(RecordError, match="precision"):
        sign("job", cfg.pool, {**body, "precision": "fp8"}, home.node_key())


def test_bf16_on_a_device_without_it_is_refused_with_what_to_submit(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    job = {"rounds": 2, "batches": 4, "batch_size": 64}
    with pytest.raises(ValueError, match="cannot autocast to bf16; submit the job with --precision fp32 or fp16"):
        Recipe.of_job({**job, "precision": "bf16"}, "cuda:0")
    assert Recipe.of_job(job, "cuda:0").precision == "fp32"  # auto falls back, and says so in status
    assert Recipe.of_job(job, "cpu").precision == "fp32"  # auto on the CPU: fp32 is faster there
    assert Recipe.of_job({**job, "precision": "bf16"}, "cpu").precision == "bf16"


def test_a_peer_that_cannot_hold_the_batch_trains_with_a_micro_batch_that_fits(charlm):
    args = {"batch_size": 64, "device": "cpu", "shards": 2}
    whole = memory_need(charlm, batch_size=64, shards=2)
    quarter = memory_need(charlm, batch_size=16, shards=2)
    room = (whole.total + quarter.total) // 2 if whole.total - quarter.total > 1024 else quarter.total
    fit = fit_batch(charlm, device_free=room, host_free=room, **args)
    assert fit.misfit is None and fit.micro_batch in (16, 32) and fit.need.total <= room
    assert fit_batch(charlm, device_free=10 * whole.total, host_free=0, **args).micro_batch == 64
    forced = fit_batch(charlm, forced=8, device_free=10 * whole.total, host_free=0, **args)
    assert forced.micro_batch == 8 and forced.misfit is None
    tiny = fit_batch(charlm, device_free=whole.host, host_free=whole.host, **args)
    assert tiny.misfit is not None and "(micro-batches down to 1 sample tried)" in tiny.misfit.message


@pytest.mark.parametrize(("fields", "error"), [
    ({"outer_warmup": 5}, "--outer-warmup (5 rounds) must be shorter than the job, which has 5 rounds"),
    ({"outer_final_lr_ratio": -0.1}, "--outer-final-lr-ratio must be between 0 and 1"),
    ({"outer_lr_schedule": "step"}, "unknown outer lr schedule 'step'"),
])
def test_a_bad_outer_schedule_is_refused_at_submit_with_what_to_change(linear, fields, error):
    from ttpeer.train import check_job

    with pytest.raises(TaskError, match=error.replace("(", r"\(").replace(")", r"\)")):
        check_job(linear, {"rounds": 5, "batches": 8, **fields})


def test_the_outer_schedule_runs_over_rounds_and_its_record_fields_are_checked(tmp_path):
    from ttpeer.train import outer_lr

    job = {"rounds": 10, "outer_lr": 0.5, "outer_lr_schedule": "linear", "outer_warmup": 2,
           "outer_final_lr_ratio": 0.0}
    assert [outer_lr(job, r) for r in (0, 1, 2, 6)] == pytest.approx([0.5 / 3, 1.0 / 3, 0.5, 0.25])
    assert outer_lr({"rounds": 10, "outer_lr": 0.5}, 9) == 0.5
    home, cfg, body = _pool_and_job(tmp_path)
    sign("job", cfg.pool, {**body, "outer_lr_schedule": "cosine", "outer_warmup": 4, "outer_final_lr_ratio": 0.1},
         home.node_key())
    with pytest.raises(RecordError, match="outer_warmup"):
        sign("job", cfg.pool, {**body, "outer_warmup": 5}, home.node_key())
    with pytest.raises(RecordError, match="outer_lr_schedule"):
        sign("job", cfg.pool, {**body, "outer_lr_schedule": "step"}, home.node_key())
