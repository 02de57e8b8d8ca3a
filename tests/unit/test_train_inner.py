"""Local training: peers train shards, deltas feed the outer step, accuracy rises."""

from pathlib import Path

import pytest
import torch

from ttpeer.train import (
    CheckpointError,
    InnerTrainer,
    OuterState,
    TrainError,
    decode_delta,
    encode_delta,
    init_state,
    load_task,
    outer_step,
    shard_indices,
    state_hash,
)

torch.set_num_threads(1)

FIXTURE = Path(__file__).parent / "fixtures" / "task_linear.py"


@pytest.fixture(scope="module")
def mnist(builtin_data):
    return load_task("mnist1d", builtin_data)


@pytest.fixture(scope="module")
def linear():
    return load_task(str(FIXTURE), Path("/nonexistent"))


@pytest.mark.slow
def test_two_peers_improve_mnist1d_accuracy(mnist):
    state = init_state(mnist, seed=0)
    peers = [InnerTrainer(mnist, seed=i) for i in range(2)]
    residuals: list[dict | None] = [None, None]
    _, init_accuracy = peers[0].evaluate(state.params)
    for round_ in range(6):
        deltas = []
        for shard, peer in enumerate(peers):
            peer.start(state)
            batches = shard_indices(mnist.n_train, 0, round_, shard, 2, 20, mnist.batch_size)
            samples = peer.train_shard(batches)
            assert samples == 20 * 64
            wire, residuals[shard] = encode_delta(peer.delta(state), residuals[shard])
            deltas.append((decode_delta(wire, state), samples))
        state = outer_step(state, deltas)
    loss, accuracy = peers[1].evaluate(state.params)
    assert init_accuracy < 0.2
    assert accuracy > 0.3 and loss < 2.0


def test_init_state_is_seeded_and_leaves_global_rng_alone(linear):
    torch.manual_seed(99)
    expected_next = torch.rand(1)
    torch.manual_seed(99)
    first, second = init_state(linear, 3), init_state(linear, 3)
    assert torch.equal(torch.rand(1), expected_next)
    assert state_hash(first) == state_hash(second) != state_hash(init_state(linear, 4))
    assert all(torch.equal(m, torch.zeros_like(m)) for m in first.momentum.values())
    assert list(first.params) == ["weight", "bias"]


@pytest.mark.slow
def test_delta_is_zero_before_training_and_base_minus_local_after(linear):
    state = init_state(linear, 0)
    trainer = InnerTrainer(linear, lr=1e-2)
    trainer.start(state)
    assert all(torch.equal(d, torch.zeros_like(d)) for d in trainer.delta(state).values())
    trainer.train_shard(shard_indices(linear.n_train, 0, 0, 0, 1, 4, linear.batch_size))
    local = {n: t.detach() for n, t in trainer.model.state_dict().items()}
    delta = trainer.delta(state)
    assert all(torch.equal(delta[n], state.params[n] - local[n]) for n in delta)
    assert any(d.abs().max() > 0 for d in delta.values())


@pytest.mark.slow
def test_emulated_compute_makes_each_step_last_step_s_and_trains_the_same_bits(linear):
    # --step-s (benchmarks): a step lasts at least step_s however fast the machine is, and
    # what it trains is the step's own arithmetic: the same delta as without it.
    import time

    slow = load_task(str(FIXTURE), Path("/nonexistent"), {"step_s": 0.05})
    batches = shard_indices(linear.n_train, 0, 0, 0, 1, 3, linear.batch_size)
    deltas = []
    for task in (linear, slow):
        trainer = InnerTrainer(task)
        base = init_state(task, 0)
        trainer.start(base)
        began = time.perf_counter()
        trainer.train_shard(batches)
        deltas.append((time.perf_counter() - began, encode_delta(trainer.delta(base), None)[0]))
    assert deltas[1][0] >= 3 * 0.05
    assert deltas[0][1] == deltas[1][1]


@pytest.mark.slow
def test_should_stop_ends_the_shard_between_batches(linear):
    trainer = InnerTrainer(linear)
    trainer.start(init_state(linear, 0))
    batches = shard_indices(linear.n_train, 0, 0, 0, 1, 10, linear.batch_size)
    asked = []

    def stop_after_three():
        asked.append(1)
        return len(asked) > 3

    assert trainer.train_shard(batches, should_stop=stop_after_three) == 3 * linear.batch_size
    assert trainer.train_shard(batches, should_stop=lambda: True) == 0


@pytest.mark.slow
def test_evaluate_does_not_disturb_the_local_model(linear):
    trainer = InnerTrainer(linear)
    state = init_state(linear, 0)
    trainer.start(state)
    trainer.train_shard(shard_indices(linear.n_train, 0, 0, 0, 1, 3, linear.batch_size))
    before = trainer.delta(state)
    zeros = {n: torch.zeros_like(t) for n, t in state.params.items()}
    loss, accuracy = trainer.evaluate(zeros)
    assert loss == pytest.approx(torch.log(torch.tensor(2.0)).item(), rel=1e-5)
    assert 0.0 <= accuracy <= 1.0
    after = trainer.delta(state)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_mismatched_base_raises_checkpoint_error(linear):
    trainer = InnerTrainer(linear)
    wrong = OuterState(params={"weight": torch.zeros(2, 8)}, momentum={})
    with pytest.raises(CheckpointError, match="missing"):
        trainer.start(wrong)
    wrong = OuterState(params={"weight": torch.zeros(3, 8), "bias": torch.zeros(2)}, momentum={})
    with pytest.raises(CheckpointError, match="shape"):
        trainer.start(wrong)


@pytest.mark.slow
def test_divergence_raises_train_error_and_resets_adamw(linear):
    trainer = InnerTrainer(linear, lr=1e30)
    trainer.start(init_state(linear, 0))
    with pytest.raises(TrainError, match="diverged"):
        trainer.train_shard(shard_indices(linear.n_train, 0, 0, 0, 1, 8, linear.batch_size))
    assert not trainer.optimizer.state
