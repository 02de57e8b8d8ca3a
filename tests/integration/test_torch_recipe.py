"""Precision, micro-batches and schedules through the real executor and real nodes: a
bf16 job trains as well as its fp32 twin and every peer ends bit-identical; a shard
trained again elsewhere (requeued, stolen) gets the same lr at every step; a peer whose
memory cannot hold the batch trains it in micro-batches instead of declining."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from ttpeer import train
from ttpeer.daemon import Home
from ttpeer.daemon.service._views import peer_rows
from ttpeer.daemon.worker._torch import TorchExecutor
from ttpeer.proto import JobSpec, PublishDelta, Train, sign

from .test_torch_nodes import FP, RELAY, _homes, run_jobs

TASK = "charlm:n_layer=1,d_model=32,block_size=16"
SPEC = {"task": TASK, "mode": "fused", "rounds": 3, "shards": 2, "batches": 8, "batch_size": 16,
        "inner_lr": 3e-3, "weight_decay": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8, "seed": 1,
        "lease": 10.0, "steal": True}
# bf16 autocast rounds activations to 8 bits of mantissa; after this job's 3 x 8 inner steps
# its eval loss stays within 1% of the fp32 job's (measured: under 0.1%).
MARGIN = 0.01


async def test_bf16_jobs_on_real_nodes_end_bit_identical_and_fine_tune_from_a_finished_job(tmp_path: Path) -> None:
    # The README's fine-tuning path: a job, then one warm-started from its final model
    # with a cosine schedule and warm-up, both in bf16.
    homes = _homes(tmp_path)
    (base,), nodes = await run_jobs(homes, [{**SPEC, "precision": "bf16"}], None)
    final = homes[0].path / "states" / base.id / "final.safetensors"
    tune = {**SPEC, "rounds": 2, "precision": "bf16", "seed": 9, "lr_schedule": "cosine", "warmup": 4,
            "final_lr_ratio": 0.1, "inner_lr": 1e-3, "init": str(final)}
    (tuned,), tuned_nodes = await run_jobs(homes, [tune], None)
    for job, run in ((base, nodes), (tuned, tuned_nodes)):
        finals = {hashlib.sha256((h.path / "states" / job.id / "final.safetensors").read_bytes()).hexdigest()
                  for h in homes}
        assert len(finals) == 1
        rows = [r for r in peer_rows(run[0].machine.records, job, run[0].machine.chain(job)) if r["contributions"]]
        assert rows and {(r["precision"], r["micro_batch"]) for r in rows} == {("bf16", 16)}
    # It started from the finished job's weights, not from a fresh model of its seed.
    task = train.load_task(TASK, homes[0].data_dir)
    assert tuned["init"] == train.state_hash(train.warm_state(task, final)) != train.state_hash(
        train.init_state(task, 9))
    first = [c["metrics"]["eval_loss"] for c in (nodes[0].machine.chain(base).closes[0],
                                                  tuned_nodes[0].machine.chain(tuned).closes[0])]
    assert first[1] < first[0]  # its first round already starts from a trained model


async def test_bf16_trains_as_well_as_fp32_and_every_peer_reproduces_each_close(tmp_path: Path) -> None:
    # Two executors, each training its own shard every round, in a fixed order: the losses
    # compared are the same every run (which peer trains what on real nodes is not).
    losses = {}
    for precision in ("fp32", "bf16"):
        homes = _homes(tmp_path / precision)
        peers = [await _prepared(home, {**SPEC, "precision": precision}) for home in homes]
        base = peers[0][2]
        for rnd in range(SPEC["rounds"]):
            deltas = []
            for shard, (executor, job, _, _) in enumerate(peers):
                samples = await executor.train(Train(job, rnd, shard, 0, base, fresh=True), lambda: False)
                data, _ = await executor.delta(PublishDelta(job, rnd, base, (shard,), samples))
                deltas.append((data, samples))
            (first, job0, _, _), (second, job1, _, _) = peers
            new, metrics = await first.aggregate(job0, base, deltas, rnd=rnd)
            assert await second.apply(job1, base, deltas, new, rnd=rnd)  # fp32 outer step: the same bits
            base = new
        losses[precision] = metrics["eval_loss"]
    assert losses["fp32"] < 4.5  # it learned (ln 256 = 5.5 at the start)
    assert abs(losses["bf16"] - losses["fp32"]) <= MARGIN * losses["fp32"], losses


async def _prepared(home: Home, spec: dict, memory_limit: int | None = None) -> tuple:
    executor = TorchExecutor(home, memory_limit=memory_limit)
    fixed, init = await executor.new_job(spec, None)
    body = {**spec, **fixed, "init_blob": "0" * 64, "task_blob": "", "at": int(time.time())}
    job = JobSpec.of(sign("job", home.config().pool, body, home.node_key()))
    decline = await executor.prepare(job, None)
    if decline is None:
        assert await executor.import_state(job, fixed["init"], init)
    return executor, job, fixed["init"], decline


async def test_a_shard_trained_again_on_another_peer_gets_the_same_lr_at_every_step(tmp_path: Path) -> None:
    spec = {**SPEC, "lr_schedule": "cosine", "warmup": 5, "final_lr_ratio": 0.1}
    homes = _homes(tmp_path)
    runs = []
    for home, history in zip(homes, ([(0, 0), (0, 1), (1, 0)], []), strict=True):
        executor, job, s0, _ = await _prepared(home, spec)
        trainer = executor._jobs[job.id].trainer
        for rnd, shard in history:  # the first peer trained other shards before
            await executor.train(Train(job, rnd, shard, 0, s0, fresh=True), lambda: False)
        seen: list[float] = []
        trainer.optimizer.register_step_pre_hook(lambda opt, *_, seen=seen: seen.append(opt.param_groups[0]["lr"]))
        # Round 2, shard 1: attempt 0 on the first peer, attempt 1 (requeued) on the other.
        await executor.train(Train(job, 2, 1, len(runs), s0, fresh=True), lambda: False)
        runs.append(seen)
    schedule = train.LrSchedule("cosine", warmup=5, total=24, final_ratio=0.1)
    assert runs[0] == runs[1] == [3e-3 * schedule.factor(s) for s in range(16, 24)]


async def test_a_peer_short_of_memory_for_the_batch_trains_in_micro_batches(tmp_path: Path) -> None:
    home = Home(tmp_path / "a")
    home.create_pool(RELAY, FP, "a", time.time())
    task = train.load_task(TASK, home.data_dir)
    spec = {**SPEC, "batch_size": 64}
    args = {"shards": 2, "held_states": 3, "overlap": False}
    whole = train.memory_need(task, batch_size=64, **args).total
    eighth = train.memory_need(task, batch_size=8, **args).total
    assert eighth < whole
    executor, job, s0, decline = await _prepared(home, spec, memory_limit=(whole + eighth) // 2)
    assert decline is None  # before micro-batches, this peer declined the job
    recipe = executor._jobs[job.id].trainer.recipe
    assert recipe.micro_batch is not None and 8 <= recipe.micro_batch < 64
    samples = await executor.train(Train(job, 0, 0, 0, s0, fresh=True), lambda: False)
    assert samples == 8 * 64  # the job's batches, whole
    _, metrics = await executor.delta(PublishDelta(job, 0, s0, (0,), samples))
    assert metrics["micro_batch"] == recipe.micro_batch and metrics["precision"] == 32
    _, _, _, refused = await _prepared(home, {**spec, "seed": 2}, memory_limit=eighth // 4)
    assert refused is not None and "micro-batches down to 1 sample tried" in refused.reason


async def test_the_outer_lr_follows_its_schedule_round_by_round_and_every_peer_reproduces_it(tmp_path: Path) -> None:
    spec = {**SPEC, "rounds": 4, "outer_lr_schedule": "cosine", "outer_warmup": 1, "outer_final_lr_ratio": 0.2}
    schedule = train.LrSchedule.outer_of_job(spec)
    assert [train.outer_lr(spec, r) for r in range(4)] == [0.7 * schedule.factor(r) for r in range(4)]
    assert len({train.outer_lr(spec, r) for r in range(4)}) == 4  # a different outer lr every round
    assert {train.outer_lr(SPEC, r) for r in range(3)} == {0.7}  # constant: exactly the job's outer_lr
    homes = _homes(tmp_path)
    (first, job0, s0, _), (second, job1, _, _) = [await _prepared(home, spec) for home in homes]
    samples = await first.train(Train(job0, 0, 0, 0, s0, fresh=True), lambda: False)
    data, _ = await first.delta(PublishDelta(job0, 0, s0, (0,), samples))
    deltas = [(data, samples)]
    by_round = {}
    for rnd in (0, 2):
        by_round[rnd], _ = await first.aggregate(job0, s0, deltas, rnd=rnd)
    assert by_round[0] != by_round[2]  # the round's outer lr, not the job's constant
    assert await second.apply(job1, s0, deltas, by_round[2], rnd=2)  # the same bits on the follower
    assert not await second.apply(job1, s0, deltas, by_round[2], rnd=1)  # another round's lr: another state
    # By hand: the outer step of round 2 at its scheduled lr is the state the closer held.
    task = train.load_task(TASK, homes[0].data_dir)
    like = train.template(train.init_state(task, SPEC["seed"]))
    base = train.state_from_bytes(train.state_to_bytes(train.init_state(task, SPEC["seed"])), like=like)
    assert train.state_hash(base) == s0
    expect = train.outer_step(base, [(train.decode_delta(data, like), samples)], lr=train.outer_lr(spec, 2),
                              momentum=SPEC["outer_momentum"], nesterov=True)
    assert train.state_hash(expect) == by_round[2]
