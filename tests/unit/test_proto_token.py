"""Join tokens: round trip, hostile tokens, and secrets that never reach a message."""

from __future__ import annotations

import base64
import dataclasses
import json
import traceback
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttpeer.proto import Record, Token, TokenError, encode, make_token, parse_token

from .proto_helpers import Pool, key, seed_of

P = Pool("token")
Q = Pool("token-other")
IK = key("token-ik")
SEED = seed_of(IK)
INVITE = P.invite(IK, uses=3, expires=10_000)
FP = "sha256:" + "5e" * 32
RELAYS = ["https://relay.example:8443", "https://backup.example"]
NOW = 5_000.0


def unpack(token: str) -> dict[str, Any]:
    payload = token[len("ttp1."):]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def repack(obj: Any) -> str:
    return "ttp1." + base64.urlsafe_b64encode(encode(obj)).decode().rstrip("=")


def fields(*, invite: Record = INVITE, seed: bytes = SEED, relays: list[str] = RELAYS, fp: str = FP) -> dict[str, Any]:
    """The token object as ``make_token`` spells it, whatever encoding it uses for each field."""
    return unpack(make_token(relays, fp, invite, seed))


def body(**over: Any) -> dict[str, Any]:
    b = fields()
    b.update(over)
    return b


def assert_refused(text: str, *, now: float = NOW, says: str = "", secrets: tuple[str, ...] = ()) -> TokenError:
    with pytest.raises(TokenError) as info:
        parse_token(text, now=now)
    exc = info.value
    # What a traceback prints of the data: every message of the chain (its frames are code
    # and paths, which a short random payload can match by chance, e.g. 'bootstrap-re').
    chain: list[BaseException] = []
    at: BaseException | None = exc
    while at is not None and at not in chain:
        chain.append(at)
        at = at.__cause__ or at.__context__
    shown = str(exc) + repr(exc) + "".join("".join(traceback.format_exception_only(e)) for e in chain)
    assert says in str(exc)
    payload = text.strip()[5:]
    for secret in (SEED.hex(), fields()["seed"], *secrets, *([text.strip(), payload] if len(payload) >= 12 else [])):
        assert secret not in shown
    return exc


def test_fields_come_from_make_token() -> None:
    assert set(fields()) == {"relays", "fp", "pool", "invite", "seed"}
    assert repack(fields()) == make_token(RELAYS, FP, INVITE, SEED)


# -- round trip -------------------------------------------------------------------------


def _fitted(suffix_len: int) -> str:
    return make_token([RELAYS[0] + "/" + "p" * suffix_len], FP, INVITE, SEED)


def test_make_parse_round_trip_keeps_every_field() -> None:
    tok = parse_token("  " + make_token(RELAYS, FP, INVITE, SEED) + "\n", now=NOW)
    assert tok == Token(tuple(RELAYS), FP, P.id, INVITE, SEED)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text("abcdefghijklmnopqrstuvwxyz0123456789.-/:", max_size=60), min_size=1, max_size=8),
       st.integers(1, 10_000))
def test_make_parse_round_trip_for_any_relays(paths: list[str], uses: int) -> None:
    relays = ["https://" + p for p in paths]
    invite = P.invite(IK, uses=uses, expires=10_000)
    tok = parse_token(make_token(relays, FP, invite, SEED), now=NOW)
    assert (tok.relays, tok.fingerprint, tok.pool, tok.invite, tok.seed) == (tuple(relays), FP, P.id, invite, SEED)


def test_make_parse_round_trip_for_every_length() -> None:
    for n in range(12):
        tok = parse_token(_fitted(n), now=NOW)
        assert tok.relays == (RELAYS[0] + "/" + "p" * n,)
        assert (tok.fingerprint, tok.pool, tok.invite, tok.seed) == (FP, P.id, INVITE, SEED)


def test_token_repr_hides_the_seed() -> None:
    tok = parse_token(repack(body()), now=NOW)
    for shown in (repr(tok), str(tok), f"{tok}", repr([tok])):
        assert SEED.hex()[:16] not in shown and repr(SEED)[:16] not in shown and fields()["seed"][:16] not in shown
        assert repack(body())[5:][:40] not in shown
    assert P.id in repr(tok)


def test_token_expires_after_the_invite() -> None:
    text = repack(body())
    assert parse_token(text, now=INVITE["expires"]).invite == INVITE
    assert_refused(text, now=INVITE["expires"] + 0.5, says="expired")


# -- hostile tokens -------------------------------------------------------------------------

WRONG_KEY = key("token-wrong")
Q_INVITE = Q.invite(IK, expires=10_000)
FORGED_INVITE = P.invite(IK, expires=10_000, signer=key("token-mallory"))
JOIN = P.join(INVITE, key("token-node"), signer=IK)
TAMPERED = dataclasses.replace(INVITE, raw=INVITE.raw.replace(b'"uses":3', b'"uses":9'))

STRUCTURED: dict[str, tuple[dict[str, Any], str]] = {
    "invite from another pool": (body(invite=fields(invite=Q_INVITE)["invite"]), "not signed by the root"),
    "pool of the other invite": (body(pool=Q.id), "not signed by the root"),
    "invite signed by a non-root key": (body(invite=fields(invite=FORGED_INVITE)["invite"]), "not signed by the root"),
    "a join instead of an invite": (body(invite=fields(invite=JOIN)["invite"]), "not signed by the root"),
    "seed of another key": (body(seed=fields(seed=seed_of(WRONG_KEY))["seed"]), "does not match"),
    "short seed": (body(seed=fields(seed=SEED[:-1])["seed"]), "damaged"),
    "seed not hex": (body(seed="zz" * 32), "damaged"),
    "seed not a string": (body(seed=5), "damaged"),
    "tampered invite": (body(invite=fields(invite=TAMPERED)["invite"]), "damaged or forged"),
    "invite not hex": (body(invite="not hex"), "damaged or forged"),
    "invite a list": (body(invite=[1]), "damaged or forged"),
    "http relay": (body(relays=["http://relay.example"]), "relay"),
    "no relay": (body(relays=[]), "relay"),
    "too many relays": (body(relays=[RELAYS[0]] * 9), "relay"),
    "relay not a list": (body(relays=RELAYS[0]), "relay"),
    "relay not a string": (body(relays=[7]), "relay"),
    "fingerprint wrong": (body(fp="sha1:" + "5e" * 20), "fingerprint"),
    "fingerprint upper": (body(fp="sha256:" + "5E" * 32), "fingerprint"),
    "missing seed": ({k: v for k, v in body().items() if k != "seed"}, "damaged"),
    "extra field": (body(extra=1), "damaged"),
    "not an object": ({"x": [body()]}, "damaged"),
}


def test_packed_genuine_body_parses() -> None:  # the control for the cases below
    assert parse_token(repack(body()), now=NOW).invite == INVITE


@pytest.mark.parametrize("case", sorted(STRUCTURED))
def test_structurally_valid_hostile_tokens_are_refused(case: str) -> None:
    obj, says = STRUCTURED[case]
    assert_refused(repack(obj), says=says)


def test_fingerprint_with_trailing_newline_is_refused() -> None:
    assert_refused(repack(body(fp=FP + "\n")), says="fingerprint")


@pytest.mark.parametrize("text", [
    "", "ttp1.", "ttp1", "ttp2." + repack(body())[5:], "TTP1." + repack(body())[5:], "x" + repack(body()),
    repack(body())[5:], "ttp1.!!!!####", "ttp1.\u00e9\u00e9\u00e9\u00e9", "ttp1." + "A" * 9000,
    "ttp1.e30", "ttp1." + base64.urlsafe_b64encode(b"[1,2]").decode(),
    "ttp1." + base64.urlsafe_b64encode(b'{"relays": []}').decode(),
])
def test_malformed_tokens_are_refused(text: str) -> None:
    assert_refused(text)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_truncated_tokens_are_refused(data: st.DataObject) -> None:
    text = repack(body())
    cut = data.draw(st.integers(0, len(text) - 1))
    assert_refused(text[:cut], secrets=(text[5:][:40],))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_tokens_with_a_changed_character_are_refused(data: st.DataObject) -> None:
    text = repack(body())
    pos = data.draw(st.integers(5, len(text) - 2))  # the last char may carry only padding bits
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    new = data.draw(st.sampled_from(alphabet).filter(lambda c: c != text[pos]))
    changed = text[:pos] + new + text[pos + 1:]
    try:
        tok = parse_token(changed, now=NOW)
    except TokenError as exc:
        assert SEED.hex() not in str(exc) and fields()["seed"] not in str(exc) and changed[5:][:40] not in str(exc)
        return
    # A change that still parses can only have altered a relay URL or fingerprint character.
    assert tok.invite == INVITE and tok.seed == SEED


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=12, max_size=200))
def test_fuzz_random_text_raises_only_token_error(text: str) -> None:
    assert_refused(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_=", min_size=8,
               max_size=300))
def test_fuzz_base64_garbage_raises_only_token_error(payload: str) -> None:
    assert_refused("ttp1." + payload)


def test_a_token_carries_each_relays_own_pin_and_an_old_one_shares_one() -> None:
    other = "sha256:" + "7a" * 32
    tok = parse_token(make_token(RELAYS, FP, INVITE, SEED, fingerprints=[FP, other]), now=NOW)
    assert tok.relay_pairs() == [(RELAYS[0], FP), (RELAYS[1], other)]
    # One pin for all (every token made before there were several): no "fps", as before.
    same = make_token(RELAYS, FP, INVITE, SEED, fingerprints=[FP, FP])
    assert "fps" not in unpack(same) and same == make_token(RELAYS, FP, INVITE, SEED)
    assert parse_token(same, now=NOW).relay_pairs() == [(RELAYS[0], FP), (RELAYS[1], FP)]


@pytest.mark.parametrize("fps", [["sha256:" + "7a" * 32], "sha256:x", [FP, "md5:00"],
                                 ["sha256:" + "7a" * 32, FP]])
def test_damaged_relay_pins_are_refused(fps: Any) -> None:
    assert_refused(repack(body(fps=fps)), says="relay fingerprints are damaged")
