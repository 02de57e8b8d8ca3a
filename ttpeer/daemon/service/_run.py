"""Run the daemon in the foreground (or as a systemd service) until SIGINT or SIGTERM.

Start-up, in order: lock the home; serve the control socket (``ttpeer status``
answers from here on); tell systemd READY and start the watchdog; check and
repair the home on disk (``_integrity``, in a worker thread: big states take
time); optionally serve Prometheus metrics; then run the node (connect, replay
the record log, train) and keep each job's TensorBoard events current (``_board``).

Stopping, on SIGTERM or SIGINT: tell systemd STOPPING; hand back the claim in
flight (``PeerMachine.release``: a signed ``release`` record, so peers take the
shard at once instead of waiting for the lease); wait up to ``stop_grace``
seconds for the outbox to send it (no wait when there was no claim); then cancel
everything. Torch work runs in
worker processes (``_procexec``), which end when the daemon does; every state they
write is written atomically, so none is torn. A second signal skips the wait.

Fatal errors (a full disk, a relay that is not ours) stop the daemon and are
raised as the ``TtpeerError`` they are; the command line prints them.
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
from functools import partial
from typing import Any

import trio

from ttpeer import _logging
from ttpeer.config import direct_mode
from ttpeer.errors import MembershipEnded, TtpeerError
from ttpeer.net import MultiRelay, RelayClient
from ttpeer.proto import Timing, direct_routes

from .._home import Home
from ..data._direct import DirectStats, serve_direct
from ..data._urlsource import UrlSource
from ..node._node import Node
from ..worker._procexec import ProcessExecutor
from ._board import FOLDER as BOARD_FOLDER
from ._board import Board, run_board
from ._control import serve_control
from ._integrity import check_home_apart
from ._status_more import extend
from ._systemd import Notifier
from ._usage import TimedExecutor, TimedTransport, Usage

log = logging.getLogger("ttpeer.daemon")


def _thread_failed(args: threading.ExceptHookArgs) -> None:
    """A library's background thread died (TensorBoard's event writer on a full disk):
    one line in the log, not a traceback; the daemon goes on, and says what failed."""
    name = args.thread.name if args.thread is not None else "a thread"
    log.warning("background thread %s stopped: %s: %s", name, args.exc_type.__name__, args.exc_value)
    if args.exc_value is not None:  # always, when threading calls the hook
        log.debug("background thread %s", name, exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def _register_secrets(home: Home) -> None:
    for name in ("node.key", "seal.key", "pool.key", "root.key"):
        path = home.path / name
        if path.exists():
            _logging.add_secret(path.read_bytes())
    if home.path.joinpath("pool.keys").exists():
        for key in home.pool_keys():  # every epoch's pool key, after a rotation
            _logging.add_secret(key)


async def run_daemon(
    home: Home, *, device: str = "cpu", task_options: dict[str, Any] | None = None,
    proxy: str | None = None, timing: Timing = Timing(), metrics: str = "", stop_grace: float = 5.0,
    notifier: Notifier | None = None, memory_limit: int | None = None, workers: int | None = None,
    data_cache: int | None = None, direct: str = "auto",
) -> None:
    """Serve this home's membership until a signal arrives. Raises ``TtpeerError`` for
    what stops the daemon (another daemon on this home, a relay that is not ours, a
    full disk)."""
    home.lock()
    threading.excepthook = _thread_failed
    ended = home.ended()
    if ended is not None:  # revoked, or lost its token's race: starting cannot help
        home.unlock()
        raise MembershipEnded(ended)
    # Files in flight between this daemon and its workers (a checkpoint being sealed, a
    # state being fetched) from a run that crashed: model-sized, and nothing reads them.
    shutil.rmtree(home.path / "work", ignore_errors=True)
    try:
        await _serve(home, device=device, task_options=task_options, proxy=proxy, timing=timing,
                     metrics=metrics, stop_grace=stop_grace, notifier=notifier or Notifier(None),
                     memory_limit=memory_limit, workers=workers, data_cache=data_cache,
                     direct=direct)
    except BaseExceptionGroup as group:
        match, _rest = group.split(TtpeerError)
        if match is None:
            raise
        first: TtpeerError | BaseExceptionGroup[TtpeerError] = match
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    finally:
        home.unlock()


async def _serve(home: Home, *, device: str, task_options: dict[str, Any] | None, proxy: str | None,
                 timing: Timing, metrics: str, stop_grace: float, notifier: Notifier,
                 memory_limit: int | None = None, workers: int | None = None,
                 data_cache: int | None = None, direct: str = "auto") -> None:
    cfg = home.config()
    _register_secrets(home)
    node_key = home.node_key()

    def relay(url: str, fp: str) -> RelayClient:
        return RelayClient(url, fp, pool=cfg.pool, peer_key=node_key, proof=cfg.proof, proxy=proxy)

    # Every relay of the pool, each pinned by its own certificate (net/_multi.py); uploads
    # kept for re-sending are hard links in HOME/work, which every start clears.
    client = MultiRelay(cfg.relay_pairs(), relay, spool=home.path / "work" / "sent")
    usage = Usage()
    executor = ProcessExecutor(home, device=device, task_options=task_options, memory_limit=memory_limit,
                               workers=workers)
    node = Node(home, TimedTransport(client, usage), TimedExecutor(executor, usage), timing=timing)
    if data_cache is not None:
        node.data.cache_bytes = data_cache
    node.data.urls = UrlSource(proxy=proxy)  # a dataset's https addresses, through the relay's proxy
    repairs: list[str] = []
    metrics_url: str | None = None
    ready = trio.Event()

    def status() -> dict[str, Any]:
        out = extend(node.status(), node, usage, metrics_url=metrics_url, repairs=repairs)
        out["workers"] = executor.workers()  # each job's worker processes and their devices
        out["relays"] = node.relay_list()  # the pool's relays, and how this peer sees each
        served = node.data.direct_stats or DirectStats()  # direct = off: it serves nothing, still fetches
        out["direct"] = {
            "addrs": served.addrs, "served_pieces": served.served_pieces, "served_bytes": served.served_bytes,
            "served_blobs": served.served_blobs, "served_blob_bytes": served.served_blob_bytes,
            "served_ranges": served.served_ranges,
            "fetched_blob_bytes": node.data.blob_direct_bytes, "refused_blobs": node.data.blob_direct_refused,
            "refused": served.refused,
            # members whose direct record this peer holds: the ones it may fetch from
            "members": len([m for m in direct_routes(node.machine.records) if m != node.me])}
        return out

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, node, nursery.cancel_scope, notifier, stop_grace)
            await nursery.start(executor.run)  # owns the worker processes
            nursery.start_soon(executor.warm_up)  # a spare worker, off the first job's critical path
            await nursery.start(partial(serve_control, node, home.control_socket, status=status, ready=ready))
            notifier.send(ready=1, status="checking the home directory")
            nursery.start_soon(notifier.watchdog, lambda: _progress_line(node))
            repairs += await check_home_apart(home)
            if metrics:
                from ._metrics import exposition, families, serve_metrics

                def render() -> bytes:
                    trained = {j: s.shards_trained for j, s in node.counters.jobs.items()}
                    return exposition(lambda: families(status(), trained))

                try:
                    metrics_url = await nursery.start(serve_metrics, render, metrics)
                except OSError as exc:
                    raise TtpeerError(f"cannot serve metrics on {metrics}: {exc.strerror or exc} "
                                      "(choose another port with --metrics or 'metrics' in the config)") from None
            await nursery.start(_run_node, node, nursery.cancel_scope)
            nursery.start_soon(run_board, Board(home.path / BOARD_FOLDER, node, usage))
            mode = direct_mode(direct)
            if mode is not None:  # the LAN shortcut: this peer's pieces, to members that reach it
                nursery.start_soon(serve_direct, node, mode, cfg.relays[0])
            ready.set()
            print(f"ttpeer up: node {node.me[:12]} ({cfg.name}) in pool {cfg.pool[:12]}"
                  + (f"; metrics at {metrics_url}" if metrics_url else ""), flush=True)
    finally:
        node.log.close()
        node.replay.maybe_save(0.0, force=True)
        with trio.CancelScope(shield=True):
            await client.aclose()
    if node.fatal is not None:
        raise node.fatal


async def _run_node(node: Node, everything: trio.CancelScope,
                    *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    # Node.run returns when the node stops itself (a fatal error): then stop the rest too.
    await node.run(task_status=task_status)
    everything.cancel()


def _progress_line(node: Node) -> str:
    m = node.machine
    job = m.active_job()
    if job is None:
        return "idle" if node.counters.relay_ok else "connecting to the relay"
    chain = m.chain(job)
    shard = m.training
    doing = f", training shard {shard[2]}" if shard and shard[0] == job.id else ""
    rounds = m.plan(job).expected_rounds()  # counted from 1, as status counts them
    return f"job {job.id[:12]} round {min(chain.round + 1, rounds)}/{rounds}{doing}"


def _protocol_now(node: Node) -> float:
    now = getattr(node, "now", None)  # protocol time, when the node keeps one apart from trio's
    return float(now()) if callable(now) else trio.current_time()


def running(node: Node) -> bool:
    return node.life.running


def release_claims(node: Node) -> str | None:
    """Hand back the claim in flight; says which, if a release record went out."""
    if not running(node):
        return None  # not started yet: it holds no claim
    training = node.machine.training
    effects = node.machine.release(_protocol_now(node))
    node.process(effects)
    if not effects or training is None:
        return None
    job, rnd, shard = training
    return f"shard {shard} of round {rnd} (job {job[:12]})"


def outbox_idle(node: Node) -> bool:
    """Nothing queued and the sender waiting for more: everything queued has been sent."""
    stats = node.outbox_send.statistics()
    return stats.current_buffer_used == 0 and stats.tasks_waiting_receive > 0


async def _stop_on_signal(node: Node, scope: trio.CancelScope, notifier: Notifier, grace: float) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for sig in signals:
            log.warning("received %s: handing back claims, then stopping", signal.Signals(sig).name)
            break
        notifier.send(stopping=1, status="stopping: handing back claims")
        released = release_claims(node)
        # Only the release is worth waiting for: other gossip comes back through anti-entropy.
        # And only while the relay answers: with it gone nothing can confirm the release, and
        # the peers requeue the shard when its lease runs out.
        with trio.move_on_after(grace if released and node.counters.relay_ok else 0) as waited:
            async with trio.open_nursery() as inner:

                async def second_signal() -> None:
                    async for _ in signals:
                        log.warning("second signal: stopping now")
                        inner.cancel_scope.cancel()

                inner.start_soon(second_signal)
                while not outbox_idle(node) and node.counters.relay_ok:
                    await trio.sleep(0.02)
                inner.cancel_scope.cancel()
        if released:
            late = not node.counters.relay_ok or waited.cancelled_caught
            log.warning("handed back %s%s", released, " (the relay did not confirm it: the others take it "
                        "when its lease runs out)" if late else "")
        scope.cancel()
