"""Start-up is visible: while a peer prepares a job (loading the task, fetching the
initial state), its status says which phase it is in, and every peer's status shows it
as not started; once it trains, neither. Real daemons in the simulator."""

from __future__ import annotations

import trio

from ttpeer.daemon.service._views import peer_rows
from ttpeer.net import MemoryRelay
from ttpeer.testing import Simulation

from .test_simulator import SPEC

LOADING = "loading the task and its data, checking it fits"


async def test_a_preparing_peer_says_so_and_shows_as_not_started(tmp_path, autojump_clock):
    async with MemoryRelay() as relay:
        sim = Simulation(tmp_path, relay, seed=3)
        sim.create(2)
        async with trio.open_nursery() as nursery:
            await sim.start_all(nursery)
            admin, slow = sim.peers[0].node, sim.peers[1].node
            executor = sim.peers[1].executor
            assert admin is not None and slow is not None and executor is not None
            with trio.fail_after(60):
                while slow.pool_key is None:
                    await trio.sleep(0.1)
            loaded = trio.Event()
            prepare = executor.prepare

            async def slow_prepare(job, task_file):  # type: ignore[no-untyped-def]
                await loaded.wait()  # a cold data cache, a big model
                return await prepare(job, task_file)

            executor.prepare = slow_prepare  # type: ignore[method-assign]
            job_id = await sim.submit({**SPEC, "rounds": 2})

            def rows() -> dict[str, bool]:
                rs = admin.machine.records
                job = rs.by_id[job_id]
                return {r["name"]: r["started"] for r in peer_rows(rs, job, admin.machine.chain(job))}

            def phase() -> str | None:
                return next((j["phase"] for j in slow.status()["jobs"] if j["id"] == job_id), None)

            with trio.fail_after(60):
                while not (phase() == LOADING and rows().get("peer00")):
                    await trio.sleep(0.1)
            assert rows() == {"peer00": True, "peer01": False}  # the admin trains, peer01 prepares
            assert next(j["phase"] for j in admin.status()["jobs"] if j["id"] == job_id) is None
            loaded.set()
            with trio.fail_after(120):
                while not rows()["peer01"]:
                    await trio.sleep(0.1)
            assert phase() is None
            nursery.cancel_scope.cancel()
