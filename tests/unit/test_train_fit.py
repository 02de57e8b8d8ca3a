"""The memory a job needs on a peer, and the message a peer declines with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ttpeer.train import MemoryNeed, fit_problem, load_task, memory_need
from ttpeer.train._fit import RUNTIME

torch.set_num_threads(1)

FIXTURE = Path(__file__).parent / "fixtures" / "task_linear.py"


def test_need_counts_model_optimizer_outer_copies_and_activations():
    task = load_task(str(FIXTURE), Path("/nonexistent"))  # nn.Linear(8, 2): 18 fp32 parameters
    need = memory_need(task, batch_size=16, shards=5, held_states=3)
    p = 18 * 4
    # No evaluation copy beside the gradients: the close builds it once they are freed.
    assert (need.params, need.model, need.eval_copy, need.grads, need.optimizer) == (18, p, 0, p, 2 * p)
    # no held state in memory (they are files) + residual 1 + the largest working copy 2 (a delta
    # being encoded, a close's running sum becoming the new state)
    assert need.host == (1 + 2) * p
    # autograd keeps at least the input batch (16 x 8 fp32) for the backward pass; output and its grad
    assert 16 * 8 * 4 + 2 * 16 * 2 * 4 <= need.activations <= 4 * (16 * 8 * 4 + 2 * 16 * 2 * 4)
    assert need.total == need.device + need.host == 4 * p + need.activations + need.host
    assert need.resident == need.total + RUNTIME  # RSS at the peak: the processes' runtime too
    wider = memory_need(task, batch_size=64, shards=5, held_states=3)
    assert wider.activations > need.activations and wider.host == need.host
    # Deltas are added one at a time and one state is in memory: more shards, more held
    # states on disk, the same need (it grew by a model copy per shard before).
    assert memory_need(task, batch_size=16, shards=64, held_states=5) == need
    overlapped = memory_need(task, batch_size=16, shards=5, overlap=True)
    assert overlapped.host - need.host == 2 * p  # the eager start's params and this peer's own last delta


def test_an_ensemble_needs_host_memory_for_every_member():
    task = load_task(str(FIXTURE), Path("/nonexistent"))
    p = 18 * 4
    one = memory_need(task, batch_size=16, shards=4, held_states=3, members=1)
    four = memory_need(task, batch_size=16, shards=4, held_states=3, members=4)
    # held states of 6 copies a member, the round's checkpoints (3 a member), the vote (1 a member)
    assert four.host == (2 + 6 * 4 * 3 + 3 * 4 + 4) * p
    assert four.host - one.host == 3 * (6 * 3 + 3 + 1) * p
    assert four.device == one.device  # one member trains at a time


def test_need_grows_with_the_model_and_nothing_is_allocated():
    small = memory_need(load_task("charlm:n_layer=1", Path("/x")), batch_size=8, shards=2)
    # 24 layers of width 1024: about 300M parameters, 1.2 GB each copy, never allocated here
    big = memory_need(load_task("charlm:n_layer=24,d_model=1024", Path("/x")), batch_size=8, shards=2)
    assert big.params > 300_000_000 > small.params
    assert big.total > 28 * big.params + 0.5 * 2**30  # 28 bytes a parameter and one batch's activations


NEED = MemoryNeed(params=1000, model=4000, eval_copy=4000, grads=4000, optimizer=8000, activations=1000,
                  host=64000)  # 20 B/param on the device, 64 B/param of outer copies, 85 000 B in all


def test_a_model_that_fits_is_accepted():
    assert fit_problem(NEED, device="cpu", device_free=85_000, host_free=85_000) is None
    assert fit_problem(NEED, device="cuda:0", device_free=21_000, host_free=64_000) is None


@pytest.mark.parametrize(("device", "device_free", "host_free", "short", "where", "fits"), [
    # CPU: one memory; (43 500 - 1 000) / 84 B per parameter
    ("cpu", 43_500, 43_500, 85_000, "of memory", "up to about 505 parameters"),
    # GPU too small: (11 000 - 1 000) / 20 B per parameter on the device
    ("cuda:0", 11_000, 10**9, 21_000, "of memory on cuda:0", "up to about 500 parameters"),
    # GPU fine, host RAM too small for the outer copies: 32 000 / 64 B per parameter
    ("cuda", 10**9, 32_000, 64_000, "of host memory for the outer copies", "up to about 500 parameters"),
    ("cpu", 900, 900, 85_000, "of memory", "no model fits here with this batch size"),
])
def test_a_model_that_does_not_fit_is_declined_with_what_would(device, device_free, host_free, short, where, fits):
    misfit = fit_problem(NEED, device=device, device_free=device_free, host_free=host_free)
    assert misfit is not None
    assert (misfit.need, misfit.have) == (short, host_free if "host" in where else device_free)
    assert f"needs about {short / 1024:.1f} KiB {where}" in misfit.message
    assert "ttpeer does not split one model across machines" in misfit.message
    assert fits in misfit.message
    assert "(1.0K parameters)" in misfit.message
    assert "memory_limit" not in misfit.message


def test_the_message_says_when_the_limit_is_a_setting():
    misfit = fit_problem(NEED, device="cpu", device_free=43_500, host_free=43_500, limited=True)
    assert misfit is not None and "this peer has 42.5 KiB (its memory_limit setting);" in misfit.message
