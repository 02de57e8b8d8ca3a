"""The network branch of ttpeer's exception tree (the root is drawn in ``ttpeer.errors``).

::

    TtpeerError
    └── NetError                     talking to the relay failed
        ├── RelayUnavailable         could not reach the relay: refused, timed out, 5xx
        ├── RelayRejected            the relay said no (4xx) and said why
        ├── RelayFingerprintMismatch the relay's certificate is not the pinned one
        ├── RelayLimit               a relay limit was hit (413, 429, 507); see retry_after
        ├── BlobMissing              the relay does not hold the requested blob
        └── BlobCorrupt              a fetched blob is not what its hash names

Foreign exceptions (httpx, ssl, trio, OSError) are translated where ``ttpeer.net``
calls them and never escape. Each message says what happened and what to do next.

What the relay answered travels as ``status`` and ``code``: the code of its error
answer (``ttpeer_wire.ErrorCode``, or a newer one this client does not know), None when
it sent none. Code that decides matches ``status`` and ``code``, never the words.
"""

from __future__ import annotations

from ttpeer_wire import TtpeerError


class NetError(TtpeerError):
    """Talking to the relay failed. Every ``Transport`` method raises only these."""


class RelayUnavailable(NetError):
    """The relay could not be reached, timed out, or failed on its side (5xx).

    Transient by nature: retry later with backoff.
    """

    def __init__(self, url: str, detail: str, *, message: str | None = None, code: str | None = None) -> None:
        super().__init__(message or (
            f"relay {url} is unavailable ({detail}); it may be down, or unreachable "
            "from here or through the configured proxy"
        ))
        self.url = url
        self.detail = detail
        self.code = code


class RelayRejected(NetError):
    """The relay refused a request (4xx) and said why.

    Raised when admission fails (bad proof, bad signature, unknown nonce) or a
    request is malformed. Retrying the same request will fail the same way.
    """

    def __init__(self, url: str, status: int, message: str, *, code: str | None = None,
                 records: tuple[bytes, ...] = ()) -> None:
        super().__init__(f"relay {url} refused the request ({status}): {message}")
        self.url = url
        self.status = status
        self.message = message
        self.code = code
        self.records = records  # signed records the answer carried as proof (unverified bytes)


class RelayFingerprintMismatch(NetError):
    """The relay presented a TLS certificate other than the pinned one.

    Raised before any request is sent, or when a later TLS handshake fails the
    pin. Nothing was revealed to the server.
    """

    def __init__(self, url: str, expected: str, got: str) -> None:
        super().__init__(
            f"relay {url} presented certificate {got}, but the token pins {expected}. "
            "The token may point at the wrong relay (or the relay's certificate was "
            "regenerated), or someone is intercepting the connection. Nothing was sent; "
            "ask the pool admin for a fresh invite token."
        )
        self.url = url
        self.expected = expected
        self.got = got


class RelayLimit(NetError):
    """A relay limit was hit: body too large (413), too many requests (429), or a
    mailbox or the pool's storage full (507).

    ``retry_after`` is the relay's hint in seconds, or None when waiting alone will
    not help (a body over the size cap, a pool over its blob quota).
    """

    def __init__(self, url: str, status: int, message: str, retry_after: float | None, *,
                 code: str | None = None) -> None:
        hint = f"; retry in {retry_after:g} s" if retry_after is not None else ""
        super().__init__(f"relay {url} limit ({status}): {message}{hint}")
        self.url = url
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.code = code


class BlobMissing(NetError):
    """The relay does not hold the blob (never uploaded, expired, or the relay was
    reset); its owner has to upload it again."""

    def __init__(self, blob: str) -> None:
        super().__init__(
            f"blob {blob} is not on the relay (never uploaded, expired, or the relay was "
            "reset); its owner has to upload it again"
        )
        self.blob = blob


class BlobCorrupt(NetError):
    """A fetched blob does not hash to its name, or is larger than allowed. The bytes
    are discarded; fetch again, and if it repeats the relay is broken or hostile."""

    def __init__(self, blob: str, detail: str) -> None:
        super().__init__(f"blob {blob} was refused: {detail}; the bytes were discarded")
        self.blob = blob
        self.detail = detail
