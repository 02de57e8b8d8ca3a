"""Real daemons with real torch in one process: two ``Node``s with ``TorchExecutor``
over the in-memory relay train a job from a task file that only the submitter
has. The file travels sealed; both peers end bit-identical and export the same
model file."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from ttpeer.daemon import Home, Node, new_invite
from ttpeer.daemon.worker._torch import TorchExecutor
from ttpeer.net import MemoryRelay
from ttpeer.proto import Timing, Token

TASK_FILE = Path(__file__).parent.parent / "unit" / "fixtures" / "task_linear.py"
RELAY, FP = "https://relay.test.invalid", "sha256:" + "0" * 64


def _homes(root: Path) -> list[Home]:
    admin = Home(root / "a")
    cfg = admin.create_pool(RELAY, FP, "a", time.time())
    invite, key = new_invite(admin.root_key(), cfg.pool, ttl=60, uses=1, role="member", now=time.time())
    member = Home(root / "b")
    member.enroll(Token((RELAY,), FP, cfg.pool, invite, key.private_bytes_raw()), "b", time.time())
    return [admin, member]


def _nodes(relay: MemoryRelay, homes: list[Home]) -> list[Node]:
    """A ``Node`` with a ``TorchExecutor`` per home, over ``relay``."""
    out = []
    for home in homes:
        cfg = home.config()
        out.append(Node(home, relay.client(cfg.pool, home.node_key(), cfg.proof), TorchExecutor(home),
                        timing=Timing(digest_interval=0.5)))
    return out


async def run_jobs(homes: list[Home], specs: list[dict], task_file: bytes | None, timeout: float = 120
                   ) -> tuple[list, list[Node]]:
    """A ``Node`` with a ``TorchExecutor`` per home over one in-memory relay: submit each
    spec in turn from the first node and wait until every node has finished it. Returns
    the jobs and the (stopped) nodes."""
    jobs = []
    async with MemoryRelay() as relay:
        nodes = _nodes(relay, homes)
        with trio.fail_after(timeout):
            async with trio.open_nursery() as nursery:
                for node in nodes:
                    await nursery.start(node.run)
                for spec in specs:
                    job = await nodes[0].submit(spec, task_file)
                    for node in nodes:
                        await node.done_event(job.id).wait()
                    jobs.append(job)
                nursery.cancel_scope.cancel()
    return jobs, nodes


def _spec(**changes: Any) -> dict[str, Any]:
    """A fused job of the linear task file, with ``changes`` (its size, stealing, overlap)."""
    return {"task": TASK_FILE.name, "mode": "fused", "batch_size": 16, "inner_lr": 0.01, "weight_decay": 0.0,
            "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8, "seed": 3, "lease": 5.0, **changes}


@pytest.mark.parametrize("overlap", [0, 1])
async def test_task_file_job_trains_bit_identically_on_two_torch_peers(tmp_path, overlap):
    # overlap=1: each round trains on the base of the round before while that round closes.
    homes = _homes(tmp_path)
    spec = _spec(rounds=4, shards=4, batches=5, steal=True, overlap=overlap)
    (job,), _ = await run_jobs(homes, [spec], TASK_FILE.read_bytes())
    finals = [home.path / "states" / job.id / "final.safetensors" for home in homes]
    digests = {hashlib.sha256(f.read_bytes()).hexdigest() for f in finals}
    assert len(digests) == 1
    # The member never had the file: it came sealed through the relay, byte for byte.
    copies = list((homes[1].path / "tasks").glob("*.py"))
    assert [c.read_bytes() for c in copies] == [TASK_FILE.read_bytes()]
    assert (homes[1].path / "records.log").stat().st_size > 0


async def test_two_jobs_from_the_same_initial_state_both_finish(tmp_path):
    # Same task and seed: both jobs start from one state hash, held on disk under the first job.
    # Three rounds make the first job write more states than a job keeps (KEEP_STATES): its
    # initial state must survive that, as the peer remembers holding it.
    home = _homes(tmp_path)[0]
    spec = _spec(rounds=3, shards=2, batches=3, steal=True)
    async with MemoryRelay() as relay:
        cfg = home.config()
        node = Node(home, relay.client(cfg.pool, home.node_key(), cfg.proof), TorchExecutor(home),
                    timing=Timing(digest_interval=0.5))
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                first = await node.submit(spec, TASK_FILE.read_bytes())
                await node.done_event(first.id).wait()
                second = await node.submit({**spec, "rounds": 2}, TASK_FILE.read_bytes())
                await node.done_event(second.id).wait()
                nursery.cancel_scope.cancel()
    assert first["init"] == second["init"]
    for job in (first, second):
        assert (home.path / "states" / job.id / "final.safetensors").exists()


@pytest.mark.parametrize("overlap", [0, 1])
async def test_a_second_job_through_the_same_states_finishes_on_both_peers(tmp_path, overlap):
    # Same task and seed: when the peers train the same shards in the same order, the second
    # job's first rounds make the same state hashes as the first job's, whose files the first
    # job pruned (it keeps its newest few). In the WAN bench the member then counted them as
    # held and retried Train and Apply on a missing file forever; now the executor says which
    # state is missing and the peer recomputes it (test_proto_peer: a lost state, forced).
    homes = _homes(tmp_path)
    spec = _spec(rounds=6, shards=2, batches=3, steal=False, overlap=overlap)
    jobs, _ = await run_jobs(homes, [spec, spec], TASK_FILE.read_bytes(), timeout=90)
    for job in jobs:
        finals = {hashlib.sha256((h.path / "states" / job.id / "final.safetensors").read_bytes()).hexdigest()
                  for h in homes}
        assert len(finals) == 1


async def test_a_peer_that_comes_after_the_job_asks_for_a_checkpoint_and_ends_identical(tmp_path):
    """No model is sent that nobody needs: a job whose peers keep up publishes no
    checkpoint; a peer that comes after it finished asks for one (replaying 24 rounds' deltas
    would cost more), the peer that made the final state uploads it from its home (no worker:
    the job is over there), and the late peer ends bit-identical, skipping the replay."""
    homes = _homes(tmp_path)
    spec = _spec(rounds=24, shards=2, batches=2, steal=False)
    async with MemoryRelay() as relay:
        first, late = _nodes(relay, homes)
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                await nursery.start(first.run)
                job = await first.submit(spec, TASK_FILE.read_bytes())
                await first.done_event(job.id).wait()
                assert not first.machine.records.of_job(job.id, "ckpt")
                await nursery.start(late.run)
                await late.done_event(job.id).wait()
                nursery.cancel_scope.cancel()
    rs = late.machine.records
    [ask] = rs.of_job(job.id, "ckpt_want")
    [ckpt] = rs.of_job(job.id, "ckpt")
    assert ask.author == late.me and ckpt.author == first.me and ckpt["state"] == ask["state"]
    assert ckpt["round"] == spec["rounds"]  # the final state: nothing to replay after it
    finals = {hashlib.sha256((h.path / "states" / job.id / "final.safetensors").read_bytes()).hexdigest()
              for h in homes}
    assert len(finals) == 1
