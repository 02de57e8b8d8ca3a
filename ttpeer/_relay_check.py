"""A relay checked before anything is made or sent: it answers, with the certificate pinned.

``pool create`` and ``relay add`` check the relay the admin typed (``check_typed_relay``:
a usage error names what to fix); ``join`` checks its token's relays (``check_any_relay``:
the first that answers must present its pin)."""

from __future__ import annotations

import re

from ttpeer.errors import UsageError


def check_relay(url: str, fingerprint: str, proxy: str | None) -> None:
    """Fetch the relay's certificate (through ``proxy`` when set: the daemon will use
    it too) and compare it with the pin, before anything else."""
    import trio

    from ttpeer.net import RelayFingerprintMismatch, fetch_certificate, fingerprint_of

    der = trio.run(lambda: fetch_certificate(url, proxy=proxy))
    got = fingerprint_of(der)
    if got != fingerprint:
        raise RelayFingerprintMismatch(expected=fingerprint, got=got, url=url)


def check_any_relay(pairs: list[tuple[str, str]], proxy: str | None) -> None:
    """The first of a token's relays that answers must present its pin; one that is down
    is passed over (the daemon uses whichever answers). Raises the first relay's
    ``NetError`` (the others' in its message) when none answers, and
    ``RelayFingerprintMismatch`` at once for a relay presenting another certificate."""
    from ttpeer.net import NetError, RelayFingerprintMismatch

    failures: list[tuple[str, NetError]] = []
    for url, fingerprint in pairs:
        try:
            check_relay(url, fingerprint, proxy)
            return
        except RelayFingerprintMismatch:
            raise
        except NetError as exc:
            failures.append((url, exc))
    if len(failures) == 1:
        raise failures[0][1]
    raise NetError(f"{failures[0][1]}; nor do the token's other relays answer: "
                   + "; ".join(f"{url}: {exc}" for url, exc in failures[1:]))


def check_typed_relay(url: str, fingerprint: str, proxy: str | None, *, url_is: str, nothing: str) -> None:
    """A relay the admin typed (``pool create``, ``relay add``): an https URL that answers
    with the certificate given, before anything is made. ``url_is`` names the URL in errors,
    ``nothing`` says what was not done."""
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", fingerprint):
        raise UsageError("--fingerprint must look like sha256:<64 hex digits> (the relay prints it)")
    if not url.startswith("https://"):
        raise UsageError(f"{url_is} must be an https:// URL")
    from ttpeer.net import NetError, RelayFingerprintMismatch

    try:
        check_relay(url, fingerprint, proxy)
    except RelayFingerprintMismatch as exc:
        # The admin typed this pin, from the relay's own start-up line: no token is involved.
        raise UsageError(f"the relay at {url} presents certificate {exc.got}, not the --fingerprint given "
                         f"({fingerprint}): copy it from that relay's 'relay ready URL sha256:...' line, and "
                         f"check that the URL is that relay's; {nothing}") from None
    except NetError as exc:
        raise UsageError(f"{exc}; start that relay first, or check the URL; {nothing}") from None
