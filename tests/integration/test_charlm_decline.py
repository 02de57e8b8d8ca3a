"""The built-in charlm task trained by real torch daemons in one process, with one
peer too small for the model: it declines with the message, the pool sees who and
why, and the others finish the job bit-identically without waiting for it."""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from pathlib import Path

import torch
import trio

from ttpeer.daemon import Home, Node, new_invite
from ttpeer.daemon.worker._torch import TorchExecutor
from ttpeer.net import MemoryRelay
from ttpeer.proto import Timing, Token

from .test_torch_nodes import run_jobs

torch.set_num_threads(1)

RELAY, FP = "https://relay.test.invalid", "sha256:" + "0" * 64
TINY = "charlm:block_size=16,d_model=32,n_layer=1,n_head=2"
# TINY needs about 1004 KiB even in micro-batches of one sample (any shard count; 1.2 MiB while
# every peer kept its round's base in memory)
SMALL_LIMIT = 768 << 10


def _homes(root: Path, names: list[str]) -> list[Home]:
    admin = Home(root / names[0])
    cfg = admin.create_pool(RELAY, FP, names[0], time.time())
    homes = [admin]
    for name in names[1:]:
        invite, key = new_invite(admin.root_key(), cfg.pool, ttl=60, uses=1, role="member", now=time.time())
        home = Home(root / name)
        home.enroll(Token((RELAY,), FP, cfg.pool, invite, key.private_bytes_raw()), name, time.time())
        homes.append(home)
    return homes


async def test_a_peer_too_small_for_charlm_declines_and_the_rest_finish(tmp_path):
    homes = _homes(tmp_path, ["a", "b", "small"])
    spec = {"task": TINY, "mode": "fused", "rounds": 2, "shards": 4, "batches": 3, "batch_size": 8,
            "inner_lr": 3e-3, "weight_decay": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9, "bits": 8,
            "seed": 1, "lease": 10.0, "steal": False}
    limits = [None, None, SMALL_LIMIT]
    async with MemoryRelay() as relay:
        nodes = []
        for home, limit in zip(homes, limits, strict=True):
            cfg = home.config()
            transport = relay.client(cfg.pool, home.node_key(), cfg.proof)
            nodes.append(Node(home, transport, TorchExecutor(home, memory_limit=limit),
                              timing=Timing(digest_interval=0.5)))
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for node in nodes:
                    await nursery.start(node.run)
                job = await nodes[0].submit(spec, None)
                for node in nodes[:2]:
                    await node.done_event(job.id).wait()
                # The decline reaches the others by gossip; wait for it with a bound.
                while not nodes[0].status()["jobs"][0]["declines"]:
                    await trio.sleep(0.05)
                statuses = [node.status() for node in nodes]
                nursery.cancel_scope.cancel()

    small_id = statuses[2]["node"]["id"]
    mine = statuses[2]["jobs"][0]
    assert mine["state"] == "declined"
    assert "ttpeer does not split one model across machines" in mine["declined"]
    assert "this peer has 768.0 KiB (its memory_limit setting)" in mine["declined"]
    # What it needs at the smallest micro-batch it tried: one sample's activations, the rest as before.
    assert re.search(r"needs about \d{3,4}\.\d KiB of memory .* a model of up to about [\d.]+K parameters would fit "
                     r"here \(micro-batches down to 1 sample tried\)$", mine["declined"])
    [seen] = statuses[0]["jobs"][0]["declines"]
    assert (seen["peer"], seen["name"], seen["reason"]) == (small_id, "small", mine["declined"])
    assert seen["have_bytes"] == SMALL_LIMIT < seen["need_bytes"]
    assert statuses[0]["jobs"][0]["state"] == "done"
    # The small peer trained nothing; the two others end on the same model, byte for byte.
    contributors = {r.author for r in nodes[0].machine.records.of_job(job.id, "contrib")}
    assert small_id not in contributors and len(contributors) >= 1
    finals = [home.path / "states" / job.id / "final.safetensors" for home in homes[:2]]
    assert len({hashlib.sha256(f.read_bytes()).hexdigest() for f in finals}) == 1
    assert not (homes[2].path / "states" / job.id / "final.safetensors").exists()
    sidecar = json.loads(finals[0].with_suffix(".json").read_text())
    assert len(sidecar["task_info"]["corpus_sha256"]) == 64
    val = sidecar["metrics"]["eval"]
    assert abs(val["perplexity"] - math.exp(val["eval_loss"])) < 1e-3 * val["perplexity"]


async def test_charlm_trains_as_an_ensemble_and_reports_perplexity(tmp_path):
    """charlm runs in both modes: here two members on two real torch daemons; the vote's
    validation loss and perplexity (exp of the loss) come with the last close."""
    homes = _homes(tmp_path, ["a", "b"])
    spec = {"task": TINY, "mode": "ensemble", "members": 2, "rounds": 2, "shards": None, "batches": 3,
            "batch_size": 8, "inner_lr": 3e-3, "weight_decay": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9,
            "bits": 8, "seed": 1, "lease": 10.0, "steal": False}
    (job,), nodes = await run_jobs(homes, [spec], None, timeout=60)
    chain = nodes[0].machine.chain(job)
    assert chain.round == 2 and nodes[1].machine.chain(job).head == chain.head
    metrics = chain.closes[-1]["metrics"]
    assert math.isclose(metrics["perplexity"], math.exp(metrics["eval_loss"]), rel_tol=1e-4)
    assert metrics["eval_loss"] < math.log(256)  # better than a uniform guess over bytes
