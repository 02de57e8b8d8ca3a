"""Certificate pinning for relays.

Relays usually have self-signed certificates and are often reached by IP, so
ttpeer trusts a relay by the fingerprint its invite token carries, never by CA
or hostname. The flow: ``fetch_certificate`` does a bare TLS handshake (no HTTP,
verification off) and returns the DER certificate; the caller compares its
``fingerprint`` with the pinned one before sending anything; every request then
goes through ``pinned_ssl_context``, which trusts exactly that certificate, so a
server that later shows another certificate fails the handshake.
"""

from __future__ import annotations

import base64
import socket
import ssl
from urllib.parse import unquote, urlsplit

import trio

from ._errors import RelayUnavailable

_MAX_PROXY_REPLY = 16 * 1024


def pinned_ssl_context(der: bytes) -> ssl.SSLContext:
    """A client context that trusts exactly the certificate ``der`` (TLS 1.3 only)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # relays are reached by IP; the pin names the server
    context.verify_mode = ssl.CERT_REQUIRED
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # the leaf alone is the anchor
    context.load_verify_locations(cadata=der)
    return context


def host_port(url: str) -> tuple[str, int]:
    """Host and port of an ``https://`` URL. Raises ``ValueError``."""
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise ValueError(f"relay URL must look like https://HOST:PORT, not {url!r}")
    return parts.hostname, parts.port or 443


async def _open_via_proxy(proxy: str, host: str, port: int) -> trio.SocketStream:
    parts = urlsplit(proxy)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"proxy must be an http://HOST:PORT CONNECT proxy, not {proxy!r}")
    stream = await trio.open_tcp_stream(parts.hostname, parts.port or 80)
    try:
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        request = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
        if parts.username is not None:
            creds = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            request += f"Proxy-Authorization: Basic {base64.b64encode(creds).decode()}\r\n"
        await stream.send_all((request + "\r\n").encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = await stream.receive_some(4096)
            if not chunk or len(reply) > _MAX_PROXY_REPLY:
                raise OSError("the proxy closed the connection during CONNECT")
            reply += chunk
        status_line = reply.split(b"\r\n", 1)[0].decode("latin-1")
        fields = status_line.split(" ", 2)
        if len(fields) < 2 or fields[1] != "200":
            raise OSError(f"the proxy refused CONNECT {target}: {status_line!r}")
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return stream


async def open_tcp(host: str, port: int, proxy: str | None) -> trio.SocketStream:
    """A TCP stream to ``host:port``, tunnelled with CONNECT through ``proxy`` if given.

    Raises ``OSError`` (the proxy's refusal included), ``ValueError`` for a malformed proxy.
    """
    if proxy is None:
        return await trio.open_tcp_stream(host, port)
    return await _open_via_proxy(proxy, host, port)


async def fetch_certificate(url: str, *, proxy: str | None = None, timeout: float = 30.0) -> bytes:
    """The DER certificate the relay at ``url`` presents, verification off.

    Sends no HTTP, only a TLS handshake (through ``proxy`` with CONNECT if
    given). Raises ``RelayUnavailable`` if the relay cannot be reached or does not
    complete the handshake, ``ValueError`` for a malformed URL or proxy.
    """
    host, port = host_port(url)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # we only read the certificate, then compare it
    where = f" via proxy {urlsplit(proxy).hostname}" if proxy else ""
    try:
        with trio.fail_after(timeout):
            try:
                stream = await open_tcp(host, port, proxy)
            except OSError as exc:
                raise RelayUnavailable(url, connect_failure(exc), message=(
                    f"cannot reach the relay at {url}{where}: {connect_failure(exc)}")) from None
            tls = trio.SSLStream(stream, context, server_hostname=host)
            try:
                await tls.do_handshake()
                der = tls.getpeercert(binary_form=True)
            finally:
                await trio.aclose_forcefully(tls)
    except trio.TooSlowError:
        raise RelayUnavailable(url, f"no TLS handshake within {timeout:g} s") from None
    except (OSError, trio.BrokenResourceError) as exc:
        raise RelayUnavailable(url, f"TLS handshake failed{where}: {exc} (is it a ttpeer relay?)") from None
    if not der:
        raise RelayUnavailable(url, "the server presented no certificate")
    return der


def connect_failure(exc: OSError) -> str:
    """Why a TCP connection failed, in a person's words: trio reports 'all attempts to
    connect ... failed' and keeps the reason (refused, unreachable) in its cause."""
    group = exc.__cause__ if isinstance(exc.__cause__, BaseExceptionGroup) else None
    first = next((e for e in (group.exceptions if group else ()) if isinstance(e, OSError)), exc)
    if isinstance(first, ConnectionRefusedError):
        return "connection refused (is it running, and on that port?)"
    if isinstance(first, socket.gaierror):
        return "no such host name (check the URL)"
    if isinstance(first, TimeoutError):
        return "the connection timed out (is a firewall in the way?)"
    return first.strerror or str(first)
