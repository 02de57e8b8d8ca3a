"""Dataset pieces from the https addresses a dataset record names (its optional ``urls``).

Theory of operation. ``ttpeer data add PATH --url URL`` says that ``URL/<path>`` serves
each file of the dataset too: any web server, or an S3, R2 or GCS bucket through its https
address (public, or with a token in the query string that holds for every object under the
prefix, such as an Azure container SAS; the query is kept after the path). ``UrlSource``
asks one address for one piece with ``Range: bytes=offset-end`` and streams the answer to
a file, never more than the piece's size. It decides nothing about the bytes: the caller
checks them against the record's hash (``piece_ok``), so an address is trusted for
nothing, and one that serves wrong bytes only costs a fetch from the next source.

What counts as an answer: a 206 whose ``Content-Range`` is exactly the range asked; a 200
(a server that ignores Range) only for a piece that starts its file and is the whole body
(a longer body is the whole file, which is not read). Anything else, a redirect to a
non-https address included, is ``UrlFailed``, with the status when there was one.

TLS is verified against the system's trust store (OpenSSL's default paths, so
``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` point it elsewhere), or the context given (tests).
The proxy is the daemon's configuration, passed in; nothing here reads the environment.

Secrets: an address may carry a token in its query. Logs name the host alone
(``host_of``); messages for the user who typed the address name it without its query
(``shown``).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import httpx

from ttpeer.errors import TtpeerError

TIMEOUT = 30.0  # seconds without progress (connect, or between reads) before a source is given up
CONNECT_TIMEOUT = 10.0
MAX_REDIRECTS = 5
PROBE_BYTES = 64 * 1024  # what ``data add --url`` reads back of the first file
_CHUNK = 1 << 20


class UrlFailed(TtpeerError):
    """A dataset address did not serve the bytes asked for (``status``: its HTTP status,
    None when none came: refused, timed out, TLS). Raised before or while a piece is read."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def host_of(url: str) -> str:
    """What a log may say of ``url``: its host (never its path or query)."""
    return urlsplit(url).hostname or "?"


def shown(url: str) -> str:
    """``url`` for the user who gave it: without its query (a token), which is marked."""
    p = urlsplit(url)
    return urlunsplit((p.scheme, p.netloc, p.path, "", "")) + ("?..." if p.query else "")


def file_url(base: str, rel: str) -> str:
    """The address of the dataset file ``rel`` under ``base``: its path segments
    percent-quoted, after the base's path and before the base's query."""
    p = urlsplit(base)
    path = p.path.rstrip("/") + "/" + "/".join(quote(part, safe="") for part in rel.split("/"))
    return urlunsplit((p.scheme, p.netloc, path, p.query, ""))


def _content_range(value: str) -> tuple[int, int, int | None] | None:
    """(first, last, total or None) of a ``bytes first-last/total`` header, or None."""
    unit, _, rest = value.strip().partition(" ")
    span, _, total = rest.partition("/")
    first, _, last = span.partition("-")
    if unit != "bytes" or not (first.isdigit() and last.isdigit()) or not (total.isdigit() or total == "*"):
        return None
    return int(first), int(last), int(total) if total.isdigit() else None


async def _https_only(request: httpx.Request) -> None:
    if request.url.scheme != "https":
        raise UrlFailed(f"{host_of(str(request.url))} redirected to a {request.url.scheme} address; "
                        "dataset addresses are https only")


class UrlSource:
    """Range GETs of dataset pieces over https. ``proxy``: an http:// CONNECT proxy (the
    daemon's ``proxy`` setting); ``context``: the TLS trust (default: the system's)."""

    def __init__(self, *, proxy: str | None = None, context: ssl.SSLContext | None = None,
                 timeout: float = TIMEOUT) -> None:
        self.proxy = proxy
        self.context = context or ssl.create_default_context()
        self.timeout = timeout

    def client(self) -> httpx.AsyncClient:
        """A client for a few requests; the caller closes it (``async with``)."""
        return httpx.AsyncClient(
            verify=self.context, proxy=self.proxy,
            timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, CONNECT_TIMEOUT)),
            trust_env=False,  # the proxy is configuration, passed in; not read here
            follow_redirects=True, max_redirects=MAX_REDIRECTS,
            headers={"accept-encoding": "identity"},  # a Range counts bytes of the file as stored
            event_hooks={"request": [_https_only]},
        )

    async def check(self, base: str, rel: str, local: Path, piece: int, dest: Path) -> None:
        """Whether ``base`` serves ``local`` as the file ``rel`` (of ``piece``-byte pieces):
        its first bytes (a range of at most a piece and ``PROBE_BYTES``, compared with
        ``local``'s) and its size. Raises ``UrlFailed`` saying what it served instead;
        ``OSError``."""
        size = local.stat().st_size
        n = min(size, piece, PROBE_BYTES)
        async with self.client() as client:
            total = await self.get(client, base, rel, 0, n, dest)
        if total is not None and total != size:
            raise UrlFailed(f"it serves {rel} with {total} bytes, not {size}")
        with open(local, "rb") as f:
            if dest.read_bytes() != f.read(n):
                raise UrlFailed(f"the first {n} bytes it serves of {rel} are not the file's")

    async def get(self, client: httpx.AsyncClient, base: str, rel: str, offset: int, size: int,
                  dest: Path) -> int | None:
        """Write bytes ``offset`` to ``offset + size - 1`` of the file ``rel`` under ``base``
        into ``dest`` (``size`` >= 1); returns the file's size as the server gave it (None if
        it did not). Raises ``UrlFailed``; ``OSError`` writing ``dest``."""
        url = file_url(base, rel)
        try:
            async with client.stream("GET", url, headers={"range": f"bytes={offset}-{offset + size - 1}"}) as r:
                total = self._check(r, offset, size)
                got = 0
                with open(dest, "wb") as f:
                    async for chunk in r.aiter_raw(_CHUNK):
                        if got + len(chunk) > size:
                            raise UrlFailed(f"{host_of(url)} sent more than the {size} bytes asked for", r.status_code)
                        f.write(chunk)
                        got += len(chunk)
                if got != size:
                    raise UrlFailed(f"{host_of(url)} sent {got} of {size} bytes", r.status_code)
                return total
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise UrlFailed(f"{host_of(url)} could not be read ({type(exc).__name__})") from None

    def _check(self, r: httpx.Response, offset: int, size: int) -> int | None:
        """The file's size if the answer is the range asked for (else ``UrlFailed``)."""
        host = host_of(str(r.url))
        length = r.headers.get("content-length")
        if r.status_code == 206:
            span = _content_range(r.headers.get("content-range", ""))
            if span is None or span[:2] != (offset, offset + size - 1):
                raise UrlFailed(f"{host} answered another range than bytes {offset}-{offset + size - 1}", 206)
            total = span[2]
        elif r.status_code == 200:
            if offset != 0 or (length is not None and length != str(size)):
                raise UrlFailed(f"{host} ignores Range requests (it answered 200 with the whole file)", 200)
            total = int(length) if length is not None else None
        else:
            raise UrlFailed(f"{host} answered HTTP {r.status_code}", r.status_code)
        if r.headers.get("content-encoding", "identity") != "identity":
            raise UrlFailed(f"{host} sent an encoded body ({r.headers['content-encoding']})", r.status_code)
        return total
