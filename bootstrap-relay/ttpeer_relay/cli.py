"""``ttpeer-relay``: run the rendezvous relay; also ``serve`` for embedding it.

``main`` owns the process: it parses flags, configures logging to stderr, runs
``serve`` under trio until SIGINT or SIGTERM, and prints exactly one line to
stdout once the listening socket accepts connections::

    relay ready https://HOST:PORT sha256:<hex of the certificate's DER>

HOST is the listen host as given (IPv6 in brackets); PORT is the bound port, so
``--listen 127.0.0.1:0`` reports the port the kernel picked.
"""

from __future__ import annotations

import argparse
import logging
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import cast

import hypercorn.config
import hypercorn.trio
import trio
from hypercorn.typing import ASGIFramework
from ttpeer_wire import MAX_WAIT

from .app import RelayApp
from .config import GiB, KiB, MiB, RelayConfig
from .tls import ensure_certificate, pem_fingerprint

__all__ = ["RelayConfig", "RelayRunning", "main", "serve"]

log = logging.getLogger("ttpeer_relay")


@dataclass(frozen=True)
class RelayRunning:
    """What ``serve`` reports once it accepts connections."""

    url: str  # https://HOST:PORT with the real port
    fingerprint: str  # sha256:<hex>, the value tokens pin
    port: int
    app: RelayApp  # live state, for tests and status


class _HypercornConfig(hypercorn.config.Config):
    def create_ssl_context(self) -> ssl.SSLContext | None:
        context = super().create_ssl_context()
        if context is not None:  # hypercorn allows TLS 1.2; the relay does not
            context.minimum_version = ssl.TLSVersion.TLSv1_3
        return context


def _hypercorn_config(config: RelayConfig, cert: Path, key: Path) -> hypercorn.config.Config:
    hc = _HypercornConfig()
    hc.bind = [f"{config.url_host()}:{config.port}"]
    hc.certfile, hc.keyfile = str(cert), str(key)
    hc.alpn_protocols = ["h2", "http/1.1"]
    hc.h11_max_incomplete_size = 16 * KiB  # request line + headers
    hc.h2_max_header_list_size = 16 * KiB
    hc.ssl_handshake_timeout = config.handshake_timeout
    # Hypercorn counts a connection idle until a request head is complete, so this also
    # closes slow-drip (slowloris) connections that never finish their headers.
    hc.keep_alive_timeout = config.idle_timeout
    hc.read_timeout = int(MAX_WAIT) + 30  # silence on a connection, longer than any long-poll
    hc.graceful_timeout = 5.0
    hc.include_server_header = False
    hc.errorlog = logging.getLogger("ttpeer_relay.server")
    hc.accesslog = logging.getLogger("ttpeer_relay.access") if config.verbose else None
    return hc


async def serve(
    config: RelayConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    task_status: trio.TaskStatus[RelayRunning] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the relay until cancelled or until ``shutdown_trigger`` returns.

    Reports a ``RelayRunning`` through ``task_status`` once connections are
    accepted. On shutdown, long-polls are answered at once and requests in flight
    get a few seconds to finish. Raises ``ValueError`` for a bad config and
    ``OSError`` when the data directory, the certificate or the port is unusable.
    """
    config.validate()
    await trio.to_thread.run_sync(lambda: config.data.mkdir(mode=0o700, parents=True, exist_ok=True))
    if config.cert is not None and config.key is not None:
        cert, key = config.cert, config.key
    else:
        cert, key = await trio.to_thread.run_sync(ensure_certificate, config.data / "tls", config.host)
    fingerprint = pem_fingerprint(cert)
    app = RelayApp(config, fingerprint)
    await trio.to_thread.run_sync(app.load)

    async def stop() -> None:
        if shutdown_trigger is None:
            await trio.sleep_forever()
        else:
            await shutdown_trigger()
        log.info("shutting down")
        app.close()

    async with trio.open_nursery() as nursery:

        async def run_server(task_status: trio.TaskStatus[list[str]]) -> None:
            hc = _hypercorn_config(config, cert, key)
            await hypercorn.trio.serve(cast(ASGIFramework, app), hc, shutdown_trigger=stop, mode="asgi",
                                       task_status=task_status)
            nursery.cancel_scope.cancel()  # stops maintenance too

        nursery.start_soon(app.maintain)
        binds = await nursery.start(run_server)
        port = int(binds[0].rpartition(":")[2])
        url = f"https://{config.url_host()}:{port}"
        log.info("listening on %s, certificate %s", url, fingerprint)
        task_status.started(RelayRunning(url, fingerprint, port, app))


def _size(text: str) -> int:
    """``1048576``, ``512K``, ``64M``, ``1G`` (binary units)."""
    units = {"K": KiB, "M": MiB, "G": GiB}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1048576, 64M, 1G)") from None


def _parser() -> argparse.ArgumentParser:
    defaults = RelayConfig(data=Path("."))
    parser = argparse.ArgumentParser(
        prog="ttpeer-relay",
        description=(
            "Rendezvous relay for ttpeer pools: HTTPS only (TLS 1.3, HTTP/2 and HTTP/1.1). "
            "Peers log in with their pool membership proof, exchange sealed messages "
            "through mailboxes and share sealed blobs. The relay holds no pool secret."
        ),
        epilog=(
            "Without --cert/--key a self-signed certificate is made on first start in "
            "DATA/tls/ and reused after; its fingerprint (printed in the ready line) is what "
            "invite tokens pin, so keep DATA/tls/ across reinstalls. "
            "Once listening, prints one line to stdout: "
            "'relay ready https://HOST:PORT sha256:<hex>'. Logs go to stderr. "
            "SIGINT or SIGTERM stops it gracefully."
        ),
    )
    parser.add_argument("--listen", default=defaults.listen, metavar="HOST:PORT",
                        help="address to listen on; port 0 picks a free port "
                        "(default %(default)s; IPv6 as [::]:8443)")
    parser.add_argument("--data", required=True, type=Path, metavar="DIR",
                        help="state directory: tls/ and pools/<pool>/{roster.json,blobs/}")
    parser.add_argument("--cert", type=Path, metavar="PEM",
                        help="certificate chain to serve instead of the self-signed one")
    parser.add_argument("--key", type=Path, metavar="PEM", help="private key for --cert")
    parser.add_argument("--max-blob-bytes", type=_size, default=defaults.max_blob_bytes,
                        metavar="N", help="largest blob accepted (default 1G); bigger -> 413")
    parser.add_argument("--blob-ttl", type=float, default=defaults.blob_ttl, metavar="S",
                        help="seconds a blob is kept after its last upload (default 7 days)")
    parser.add_argument("--pool-quota", type=_size, default=defaults.pool_quota, metavar="N",
                        help="blob bytes stored per pool (default 20G); over it -> 507")
    parser.add_argument("--rate", type=float, default=defaults.rate, metavar="R",
                        help="requests per second per client IP or peer (default %(default)s)")
    parser.add_argument("--burst", type=int, default=defaults.burst, metavar="N",
                        help="requests allowed in a burst (default %(default)s); then 429")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log every request and more to stderr")
    return parser


async def _run(config: RelayConfig) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

        async def on_signal() -> None:
            async for signum in signals:
                log.info("received %s", signal.Signals(signum).name)
                return

        async with trio.open_nursery() as nursery:
            running = await nursery.start(partial(serve, config, shutdown_trigger=on_signal))
            print(f"relay ready {running.url} {running.fingerprint}", flush=True)


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the relay in this process until SIGINT/SIGTERM. Returns the exit status.

    Starts its own trio loop: from inside trio, run ``serve`` instead.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    config = RelayConfig(
        data=args.data, listen=args.listen, cert=args.cert, key=args.key,
        max_blob_bytes=args.max_blob_bytes, blob_ttl=args.blob_ttl, pool_quota=args.pool_quota,
        rate=args.rate, burst=args.burst, verbose=args.verbose,
    )
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    failures: list[BaseException] = []
    try:
        trio.run(_run, config)
    except* OSError as group:
        failures.extend(_leaves(group))
    for failure in failures:
        print(f"ttpeer-relay: {failure}", file=sys.stderr)
    return 1 if failures else 0
