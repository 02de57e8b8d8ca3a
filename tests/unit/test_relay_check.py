"""``join`` checks its token's relays in order: the first that answers must present its
pin, one that is down is passed over, and a wrong certificate stops it at once."""

from __future__ import annotations

import pytest

from ttpeer import _relay_check
from ttpeer.net import NetError, RelayFingerprintMismatch, RelayUnavailable

PAIRS = [("https://a.example:1", "sha256:" + "a" * 64), ("https://b.example:2", "sha256:" + "b" * 64)]


def _relays(monkeypatch, behaviour: dict[str, str]) -> list[str]:  # type: ignore[no-untyped-def]
    asked: list[str] = []

    def check(url: str, fingerprint: str, proxy: str | None) -> None:
        asked.append(url)
        if behaviour[url] == "down":
            raise RelayUnavailable(url, "connection refused")
        if behaviour[url] == "other certificate":
            raise RelayFingerprintMismatch(expected=fingerprint, got="sha256:" + "f" * 64, url=url)

    monkeypatch.setattr(_relay_check, "check_relay", check)
    return asked


def test_a_dead_first_relay_is_passed_over(monkeypatch):
    asked = _relays(monkeypatch, {PAIRS[0][0]: "down", PAIRS[1][0]: "up"})
    _relay_check.check_any_relay(PAIRS, None)
    assert asked == [PAIRS[0][0], PAIRS[1][0]]


def test_the_first_that_answers_is_enough(monkeypatch):
    asked = _relays(monkeypatch, {PAIRS[0][0]: "up", PAIRS[1][0]: "down"})
    _relay_check.check_any_relay(PAIRS, None)
    assert asked == [PAIRS[0][0]]


def test_a_wrong_certificate_stops_the_join_even_if_another_relay_would_answer(monkeypatch):
    asked = _relays(monkeypatch, {PAIRS[0][0]: "other certificate", PAIRS[1][0]: "up"})
    with pytest.raises(RelayFingerprintMismatch):
        _relay_check.check_any_relay(PAIRS, None)
    assert asked == [PAIRS[0][0]]


def test_none_answering_names_every_relay(monkeypatch):
    _relays(monkeypatch, {PAIRS[0][0]: "down", PAIRS[1][0]: "down"})
    with pytest.raises(NetError) as err:
        _relay_check.check_any_relay(PAIRS, None)
    said = str(err.value)
    assert "a.example:1" in said and "nor do the token's other relays answer: https://b.example:2:" in said
    _relays(monkeypatch, {PAIRS[0][0]: "down"})
    with pytest.raises(RelayUnavailable):  # one relay: its own error, unchanged
        _relay_check.check_any_relay(PAIRS[:1], None)
