"""The fit check counts per worker: a peer's workers share its host memory."""

from __future__ import annotations

import time
from pathlib import Path

from ttpeer import train
from ttpeer.daemon import Home
from ttpeer.daemon._executor import Decline
from ttpeer.daemon.worker._torch import KEEP_STATES, TorchExecutor
from ttpeer.proto import JobSpec, sign

TASK = Path(__file__).parent / "fixtures" / "task_linear.py"
RELAY, FP = "https://relay.test.invalid", "sha256:" + "0" * 64
SPEC = {"task": TASK.name, "mode": "fused", "rounds": 2, "shards": 2, "batches": 4, "batch_size": 16,
        "inner_lr": 0.01, "weight_decay": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8, "seed": 3,
        "lease": 5.0, "steal": True, "micro_batch": 16}  # forced: no smaller micro-batch to fall back on


async def test_two_cpu_workers_need_twice_the_memory_of_one(tmp_path: Path) -> None:
    home = Home(tmp_path / "a")
    home.create_pool(RELAY, FP, "a", time.time())
    task = train.load_task(TASK, home.data_dir)
    need = train.memory_need(task, batch_size=16, shards=2, held_states=KEEP_STATES)
    limit = int(need.total * 1.5)  # room for one worker's copy, not for two
    outcomes = []
    for world in (1, 2):
        executor = TorchExecutor(home, memory_limit=limit)
        executor.world = world
        fixed, _init = await executor.new_job(SPEC, TASK.read_bytes())
        job = JobSpec.of(sign("job", home.config().pool, {**SPEC, **fixed, "init_blob": "0" * 64, "task_blob": "",
                                               "at": int(time.time())}, home.node_key()))
        outcomes.append(await executor.prepare(job, TASK.read_bytes()))
    assert outcomes[0] is None
    assert isinstance(outcomes[1], Decline) and outcomes[1].have <= limit // 2
