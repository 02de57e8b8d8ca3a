"""One process of a baseline in ``scripts/bench/wan``: a peer alone, gloo DDP, or torchft DiLoCo.

Run by ``bench.wan`` inside a lab host (``python bench/wan_worker.py
MODE ...``). Every mode trains the model of the ttpeer task ``--task`` (loaded with
ttpeer's own ``load_task``, so the same model, data and loss as the ttpeer row) with the
settings of ttpeer's fused jobs (batch 64 unless ``--batch``, AdamW lr 2e-3 weight decay
0.01, gradients clipped to 1.0; DiLoCo outer: SGD Nesterov lr 0.7, momentum
``--outer-momentum``, every H steps) and writes JSON lines to ``--out``: ``{"t",
"samples", "loss", "busy"}`` per evaluation (rank 0 only), where ``t`` counts from the
moment every rank is connected, ``samples`` are summed over ranks and ``busy`` is this
process's seconds of inner-step compute. The single and DDP modes stop after
``--seconds`` (or ``--steps``, or at the first evaluation at or below ``--target`` with
``--stop-at-target``); the DiLoCo modes after ``--rounds`` syncs
(every rank the same number, so none is left waiting for a partner).

``busy`` for DDP cannot be timed directly (the all-reduce runs inside backward), so it
is the step count times the compute time of one step, measured on 20 warm-up steps
without synchronisation before the clock starts. ``--slowdown S`` emulates a bigger
model as ttpeer's own ``--slowdown`` does: each step's compute is followed by a sleep
of S times its duration, and counts as busy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from ttpeer.train import load_task
from ttpeer.train._spec import fetch_batch

BATCH, LR, WEIGHT_DECAY, CLIP = 64, 2e-3, 0.01, 1.0
OUTER_LR = 0.7


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.task = load_task(args.task, Path(args.data))
        self.loss = self.task.spec.loss
        self.x_test, self.y_test = fetch_batch(self.task.test, range(self.task.n_test))
        torch.manual_seed(args.seed)
        self.model: nn.Module = self.task.spec.model()
        self.gen = torch.Generator().manual_seed(1000 + args.rank)
        self.order = torch.empty(0, dtype=torch.long)
        self.out = open(args.out, "a") if args.rank == 0 else None  # noqa: SIM115
        self.t0 = time.monotonic()
        self.busy = 0.0
        self.evaluating = 0.0  # seconds rank 0 spent evaluating: off every row's clock
        self.steps = 0
        self.sync_every = 0  # DiLoCo: every such step's optimizer step also averages (not compute)
        self._last = 0.0
        self.last_loss = float("inf")
        self.fixed: float | None = None

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.args.batch
        if len(self.order) < batch:
            self.order = torch.randperm(self.task.n_train, generator=self.gen)
        idx, self.order = self.order[:batch], self.order[batch:]
        return fetch_batch(self.task.train, idx.tolist())

    def step(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        began = time.perf_counter()
        x, y = self.batch()
        opt.zero_grad(set_to_none=True)
        self.loss(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        took = time.perf_counter() - began
        self.steps += 1
        if self.fixed is not None:
            took = self.fixed  # DDP: the all-reduce ran inside backward(); count the warm-up's compute time
        elif self.sync_every and self.steps % self.sync_every == 0:
            took = self._last  # the sync blocked inside step(): count a plain step's time instead
        self._last = took
        if self.args.slowdown > 0:  # emulated compute, as ttpeer's --slowdown: the step lasts (1 + s) x
            time.sleep(self.args.slowdown * took)
        if self.args.step_s > took:  # emulated compute, as ttpeer's --step-s: the step lasts at least that long
            time.sleep(self.args.step_s - took)
        self.busy += max(took * (1 + self.args.slowdown), self.args.step_s)

    def clock(self) -> float:
        return time.monotonic() - self.t0 - self.evaluating

    def evaluate(self, model: nn.Module, world: int) -> float:
        began = time.monotonic()
        with torch.no_grad():
            model.eval()
            loss = float(self.loss(model(self.x_test), self.y_test))
            model.train()
        if self.out is not None:
            self.out.write(json.dumps({"t": self.clock(), "samples": self.steps * self.args.batch * world,
                                       "loss": loss, "busy": self.busy}) + "\n")
            self.out.flush()
        self.evaluating += time.monotonic() - began
        self.last_loss = loss
        return loss

    def over(self) -> bool:
        if self.args.stop_at_target and self.last_loss <= self.args.target:
            return True
        if self.args.steps:
            return self.steps >= self.args.steps
        return self.clock() > self.args.seconds

    def finish(self, world: int) -> None:
        if self.out is not None:
            self.out.write(json.dumps({"end": self.clock(), "busy": self.busy,
                                       "samples": self.steps * self.args.batch * world}) + "\n")
            self.out.close()


def single(run: Run) -> None:
    opt = torch.optim.AdamW(run.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    run.t0 = time.monotonic()
    run.evaluate(run.model, 1)
    while not run.over():
        run.step(run.model, opt)
        if run.steps % run.args.eval_every == 0:
            run.evaluate(run.model, 1)
    run.finish(1)


def _decide(stop: bool) -> bool:
    """Every rank stops together: rank 0's decision, broadcast."""
    import torch.distributed as dist

    flag = torch.tensor([1 if stop else 0])
    dist.broadcast(flag, 0)
    return bool(flag.item())


def ddp(run: Run) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    a = run.args
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank, world_size=a.world)
    model = DistributedDataParallel(run.model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    warm = 20
    began = time.perf_counter()
    with model.no_sync():
        for _ in range(warm):
            x, y = run.batch()
            run.loss(model(x), y).backward()
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    run.fixed = (time.perf_counter() - began) / warm
    opt.zero_grad(set_to_none=True)
    dist.barrier()
    run.t0 = time.monotonic()
    if a.rank == 0:
        run.evaluate(model, a.world)
    while True:
        run.step(model, opt)
        if run.steps % a.eval_every == 0:  # only then: a decision costs a round trip
            if a.rank == 0:
                run.evaluate(model, a.world)
            if _decide(a.rank == 0 and run.over()):
                break
    run.finish(a.world)
    dist.barrier()
    dist.destroy_process_group()


def diloco(run: Run) -> None:
    """torchft's DiLoCo: one replica group per process, a lighthouse at ``--lighthouse``."""
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    a = run.args
    # torchft's checkpoint server names itself by the hostname, which other namespaces can't resolve.
    socket.gethostname = lambda: a.host  # type: ignore[assignment]
    store = TCPStore(a.host, 0, is_master=True, wait_for_workers=False)
    model = run.model
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=a.outer_momentum, nesterov=True)

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd: dict[str, object]) -> None:
        model.load_state_dict(sd["model"])  # type: ignore[arg-type]
        inner.load_state_dict(sd["inner"])  # type: ignore[arg-type]

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=120)), min_replica_size=a.world,
        load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"peer{a.rank}",
        store_addr=a.host, store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=f"http://{a.lighthouse}", hostname=a.host, use_async_quorum=False, init_sync=False,
        timeout=timedelta(seconds=120), quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=60),
    )
    run.t0 = time.monotonic()
    if a.rank == 0:
        run.evaluate(model, a.world)
    run.sync_every = a.H
    # Both replicas sync every H steps and stop after the same number of syncs: neither waits for the other.
    with DiLoCo(manager, [model], inner, outer, sync_every=a.H, pin_memory=False):
        for _ in range(a.rounds * a.H):
            run.step(model, inner)
            if run.steps % a.H == 0 and a.rank == 0:
                run.evaluate(model, a.world)
    run.finish(a.world)
    manager.shutdown(wait=False)


def hivemind_diloco(run: Run) -> None:
    """DiLoCo over hivemind 1.1.12: every H steps a ``DecentralizedAverager`` (all-reduce in a
    group of 2 found through its DHT) averages the pseudo-gradients, then each peer applies the
    same outer Nesterov SGD. Rank 0's DHT address goes through ``--out``'s directory."""
    import hivemind
    from hivemind.averaging import DecentralizedAverager

    a = run.args
    port = 29600 + a.rank
    meet = Path(a.out).with_suffix(".maddr")
    initial: list[str] = []
    if a.rank > 0:
        deadline = time.monotonic() + 120
        while not meet.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        initial = [meet.read_text().strip()]
    dht = hivemind.DHT(host_maddrs=[f"/ip4/0.0.0.0/tcp/{port}"], announce_maddrs=[f"/ip4/{a.host}/tcp/{port}"],
                       initial_peers=initial, start=True)
    if a.rank == 0:
        mine = [str(m) for m in dht.get_visible_maddrs() if a.host in str(m)]
        meet.write_text(mine[0] + "\n")
    model = run.model
    params = list(model.parameters())
    inner = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    outer = torch.optim.SGD(params, lr=OUTER_LR, momentum=a.outer_momentum, nesterov=True)
    averager = DecentralizedAverager([torch.zeros_like(p) for p in params], dht, prefix="wan", start=True,
                                     target_group_size=a.world, min_group_size=a.world, min_matchmaking_time=1.0,
                                     request_timeout=5.0)
    base = [p.detach().clone() for p in params]
    run.sync_every = 0
    run.t0 = time.monotonic()
    run.evaluate(model, a.world)
    for _ in range(a.rounds):
        for _ in range(a.H):
            run.step(model, inner)
        with torch.no_grad(), averager.get_tensors() as tensors:
            for t, p, b in zip(tensors, params, base, strict=True):
                t.copy_(b - p)
        if averager.step(timeout=120) is None:
            raise RuntimeError("hivemind found no group to average with in 120 s")
        with torch.no_grad(), averager.get_tensors() as tensors:
            for t, p, b in zip(tensors, params, base, strict=True):
                p.copy_(b)
                p.grad = t.clone()
        outer.step()
        outer.zero_grad(set_to_none=True)
        base = [p.detach().clone() for p in params]
        run.evaluate(model, a.world)
    run.finish(a.world)
    averager.shutdown()
    dht.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/wan_worker.py")
    ap.add_argument("mode", choices=["single", "ddp", "diloco", "hivemind"])
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--master", default="")
    ap.add_argument("--lighthouse", default="")
    ap.add_argument("--host", default="")
    ap.add_argument("--H", type=int, default=100)
    ap.add_argument("--batch", type=int, default=BATCH, help=f"samples per step and rank (default {BATCH})")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--steps", type=int, default=0, help="single, DDP: stop after this many steps instead")
    ap.add_argument("--task", default="mnist1d", help="a ttpeer task name, as `ttpeer submit --task`")
    ap.add_argument("--target", type=float, default=0.0, help="only recorded: every run goes to its end, unless")
    ap.add_argument("--stop-at-target", action="store_true",
                    help="single, DDP: stop at the first evaluation at or below --target")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slowdown", type=float, default=0.0)
    ap.add_argument("--step-s", type=float, default=0.0, help="emulated compute: each step lasts at least this long")
    ap.add_argument("--rounds", type=int, default=4, help="DiLoCo modes: rounds of H steps")
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo modes: outer Nesterov momentum")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    {"single": single, "ddp": ddp, "diloco": diloco, "hivemind": hivemind_diloco}[args.mode](Run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
