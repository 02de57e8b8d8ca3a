"""Signed task files with real daemons: only the admin can submit one; every peer runs
only a file the pool root signed, and refuses an unsigned or altered one, saying why."""

from __future__ import annotations

import pytest
import trio

from ttpeer.net import MemoryRelay
from ttpeer.proto import TaskSignatureError, sign
from ttpeer.testing import Simulation

from .test_simulator import SPEC

TASK = b"# a task file\ndef build_task(options):\n    raise SystemExit('must not run unsigned')\n"


async def _declined_or_prepared(sim: Simulation, job: str, timeout: float = 60) -> None:
    with trio.fail_after(timeout):
        while not all(job in p.node.machine.declined or job in p.executor.task_files  # type: ignore[union-attr]
                      for p in sim.peers):
            await trio.sleep(0.2)


async def test_only_root_signed_task_files_run_anywhere(tmp_path, autojump_clock):
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=2)
        sim.create(3)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            admin, member = sim.peers[0].node, sim.peers[1].node
            assert admin is not None and member is not None
            spec = {**SPEC, "rounds": 1}

            # A member cannot submit a task file: it would run as code on every peer.
            with pytest.raises(TaskSignatureError, match="only the pool admin"):
                await member.submit(spec, TASK)

            # The admin can: every peer gets the file itself, byte for byte, and runs the job.
            good = await admin.submit(spec, TASK)
            await _declined_or_prepared(sim, good.id)
            for p in sim.peers:
                assert p.executor.task_files[good.id] == TASK  # type: ignore[union-attr]
                assert good.id not in p.node.machine.declined  # type: ignore[union-attr]

            # A hostile member bypasses its own daemon: it uploads an unsigned file, and an
            # altered copy of the admin's signed one, and signs job records naming them.
            signed = await admin._get_sealed(good["task_blob"])  # the envelope as stored
            altered = signed.replace(TASK.hex().encode(), (TASK + b"import os\n").hex().encode())
            reasons = {}
            for label, blob in (("not signed", TASK), ("altered", altered)):
                body = {k: good[k] for k in good.body}
                body.update(task_blob=await member._put_sealed(blob), at=good["at"] + 1 + len(reasons))
                rec = sign("job", member.cfg.pool, body, member.node_key)
                member.process(member.machine.add_local(rec, member.now()))
                await _declined_or_prepared(sim, rec.id)
                for p in sim.peers:
                    reason = p.node.machine.declined.get(rec.id)  # type: ignore[union-attr]
                    assert reason is not None and label in reason and "refusing to run it" in reason
                    assert rec.id not in p.executor.task_files  # type: ignore[union-attr]
                    status = p.node.status()  # type: ignore[union-attr]
                    assert label in str(status)  # the reason shows in status
                reasons[label] = reason
            nursery.cancel_scope.cancel()
