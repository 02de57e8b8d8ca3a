"""The wire contract's edges that ``scripts/mutation`` found unpinned: each test holds one
rule of ``ttpeer_wire`` (a bound, an ``and`` that is not an ``or``, a field that must be
present) to what its docstring or the relay's table says, through the public functions.

- network fields of ``direct`` and ``relays`` records: hosts, ports, relay urls, certificates;
- the relay API: the login bytes, the records an error answer carries, the start of a
  foreign answer's text;
- root-signed revocations and acknowledgements, a used-up token and the time it names;
- datasets: paths, urls, the manifest's order, tar keys, and the sample index of every
  format (``lines``, ``records``, ``npy``, ``tar``, ``parquet``) as ``sign`` checks it;
- records: the cross-field rules of a job, an ensemble's members, a close's weights and
  slices, the caps of lists and texts, and that records hash as their ids.

A mutant the tests cannot tell apart (a reworded message, ``strict=None`` for
``strict=False``, a bound that the record size cap already enforces) is not chased here.
Pure and fast: no processes, no clock, no torch.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID, ObjectIdentifier
from ttpeer_wire import (
    MAX_RELAYS,
    ErrorCode,
    ProofError,
    RecordError,
    dataset_id,
    error_body,
    error_records,
    host_ok,
    login_message,
    path_problem,
    read_error,
    record_files,
    samples_hash,
    sign,
    tar_key,
    token_used_by,
    token_used_message,
    urls_problem,
    verify_admit,
    verify_proof,
    verify_revocation,
)
from ttpeer_wire._proofs import utc_text

from .proto_helpers import Pool, cert_hex, dataset_body, hex64, job_body, key, state, valid_bodies

P = Pool("wire-mutants")
Q = Pool("wire-mutants-other")
AUTHOR = key("wire-mutants-author")


def refusal(kind: str, body: dict[str, Any]) -> str | None:
    """Why ``sign`` refuses ``body`` (a ``RecordError``'s words), or None when it signs it.
    Any other exception propagates: a check must fail as a ``RecordError``."""
    try:
        sign(kind, P.id, body, AUTHOR)
    except RecordError as exc:
        return str(exc)
    return None


def says(problem: str | None, words: str) -> bool:
    """Whether ``problem`` is a refusal whose reason contains ``words`` (which rule refused it,
    not how the sentence is worded)."""
    return problem is not None and words in problem


# -- network fields (``_netfields``) -----------------------------------------------------------


def test_host_ok_takes_names_and_addresses_and_nothing_half_bracketed() -> None:
    for good in ("relay.example", "a", "x-1.example.org", "192.0.2.1", "[::1]", "[2001:db8::5]", "[fe80::1:2]"):
        assert host_ok(good), good
    for bad in ("[::1", "::1]", "1::1]", "[not-an-address]", "[]", "256.1.1.1", "1.2.3", "-bad.example",
                "bad-.example", "a..b", "", "has space.example", "under_score.example"):
        assert not host_ok(bad), bad


def test_a_host_name_is_at_most_253_characters() -> None:
    name = ".".join(["a" * 63] * 3 + ["b" * 61])  # 253 characters of valid labels
    assert len(name) == 253 and host_ok(name)
    assert not host_ok(name + "b")


def _direct(addrs: Any, **over: Any) -> dict[str, Any]:
    return {"addrs": addrs, "cert": cert_hex(), "at": 1, **over}


def test_a_direct_address_needs_a_good_host_and_a_port_from_1_to_65535() -> None:
    for good in ("192.0.2.5:1", "192.0.2.5:65535", "relay.example:7000", "[::1]:7000"):
        assert refusal("direct", _direct([good])) is None, good
    for bad in ("192.0.2.5:0", "192.0.2.5:65536", "192.0.2.5:07000", "-bad-:7000", "256.0.0.1:7000",
                "[::1:7000", "192.0.2.5:", "192.0.2.5:x", "192.0.2.5"):
        assert says(refusal("direct", _direct([bad])), "an invalid 'addrs'"), bad


def test_a_direct_record_lists_one_to_four_distinct_addresses_of_at_most_300_characters() -> None:
    four = [f"192.0.2.{i}:7000" for i in range(1, 5)]
    assert refusal("direct", _direct(four)) is None
    assert refusal("direct", _direct([*four, "192.0.2.9:7000"])) is not None
    assert refusal("direct", _direct(["192.0.2.1:7000"] * 2)) is not None
    assert refusal("direct", _direct([])) is not None
    # Only a scoped IPv6 address gets this long: the cap is on the whole "host:port".
    def scoped(length: int) -> str:
        head, tail = "[fe80::1%", "]:7000"
        return head + "z" * (length - len(head) - len(tail)) + tail

    assert host_ok(scoped(300)[:-5]) and refusal("direct", _direct([scoped(300)])) is None
    assert refusal("direct", _direct([scoped(301)])) is not None


def test_a_direct_port_is_ascii_digits_and_anything_else_is_a_record_error() -> None:
    # str.isdigit() alone took non-ASCII digits: '\u00b2' then raised ValueError from int()
    # out of parse (before the signature is checked), and Arabic-Indic digits passed as a port.
    for port in ("\u00b2", "7\u00b9", "\u0667\u0660\u0660\u0660"):
        assert refusal("direct", _direct([f"192.0.2.5:{port}"])) is not None, port


FP = "sha256:" + "ab" * 32


def _relays(relays: Any) -> dict[str, Any]:
    return {"relays": relays, "n": 1, "at": 1}


def test_a_relay_url_is_https_and_9_to_255_characters() -> None:
    assert refusal("relays", _relays([["https://a", FP]])) is None
    assert refusal("relays", _relays([["https://", FP]])) is not None
    assert refusal("relays", _relays([["https://" + "r" * 247, FP]])) is None  # 255
    assert refusal("relays", _relays([["https://" + "r" * 248, FP]])) is not None  # 256


def test_a_relay_entry_that_is_not_a_url_and_a_pin_is_refused_as_a_record_error() -> None:
    for bad in ([7, FP], [["https://a.example"], FP], ["https://a.example", 7], ["https://a.example"],
                ["https://a.example", "sha256:" + "AB" * 32], "https://a.example"):
        assert says(refusal("relays", _relays([bad])), "an invalid 'relays'"), bad


def test_a_pool_names_up_to_max_relays_relays_each_once() -> None:
    many = [[f"https://r{i}.example", FP] for i in range(MAX_RELAYS + 1)]
    assert refusal("relays", _relays(many[:MAX_RELAYS])) is None
    assert refusal("relays", _relays(many)) is not None
    assert refusal("relays", _relays([many[0], [many[0][0], "sha256:" + "cd" * 32]])) is not None


@functools.cache
def _cert_of_size(size: int) -> str:
    """A self-signed certificate of exactly ``size`` DER bytes (an opaque extension pads it)."""
    k = key("cert:sized")
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sized")])
    when = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)

    def der(pad: int) -> bytes:
        builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
                   .serial_number(1).not_valid_before(when).not_valid_after(when + datetime.timedelta(days=30))
                   .add_extension(x509.UnrecognizedExtension(ObjectIdentifier("1.3.6.1.4.1.55555.1"), b"x" * pad),
                                  critical=False))
        return builder.sign(k, None).public_bytes(serialization.Encoding.DER)

    raw = der(size - (len(der(1000)) - 1000))
    assert len(raw) == size
    return raw.hex()


def test_a_direct_certificate_is_a_der_certificate_of_at_most_2048_bytes() -> None:
    assert refusal("direct", _direct(["192.0.2.5:7000"], cert=_cert_of_size(2048))) is None
    for bad in (_cert_of_size(2049), _cert_of_size(2600), 5, None, "", "abcd", "zz" * 200, cert_hex()[:-2],
                cert_hex().upper()):
        assert says(refusal("direct", _direct(["192.0.2.5:7000"], cert=bad)), "an invalid 'cert'"), str(bad)[:20]


# -- the relay API (``_relay_api``) ---------------------------------------------------------------


def test_the_login_bytes_are_the_domain_then_fingerprint_pool_and_nonce_a_line_each() -> None:
    assert login_message("sha256:f1", "p00l", "n0nce") == b"ttpeer/relay-auth/v1\nsha256:f1\np00l\nn0nce"


def test_an_error_answer_carries_at_most_16_records_as_hex_and_reads_them_back() -> None:
    records = [bytes([i, 0xAB, 0xCD]) for i in range(20)]
    body = error_body(ErrorCode.TOKEN_USED, "used", records)
    assert body == {"error": "used", "code": "token_used", "records": [r.hex() for r in records[:16]]}
    raw = json.dumps(body).encode()
    assert error_records(raw) == records[:16]
    assert read_error(raw) == (ErrorCode.TOKEN_USED, "used")
    assert error_body(ErrorCode.REVOKED, "gone") == {"error": "gone", "code": "revoked"}
    assert error_body(ErrorCode.REVOKED, "gone", []) == {"error": "gone", "code": "revoked"}


def test_error_records_skips_what_is_not_lowercase_hex_and_reads_any_bytes_safely() -> None:
    def answer(records: Any) -> bytes:
        return json.dumps({"error": "x", "code": "token_used", "records": records}).encode()

    assert error_records(answer(["abcd", "ABCD", "abc", "", 7, None, ["ab"], "zz", "0a0b"])) == [
        b"\xab\xcd", b"\x0a\x0b"]
    assert error_records(answer(["ab"] * 40)) == [b"\xab"] * 16
    for raw in (answer("abcd"), answer({"r": "ab"}), b'{"error": "x"}', b'["records", "ab"]', b"[]",
                b'"records"', b"not json", b"\xff\xfe", b"[" * 100_000, b""):
        assert error_records(raw) == [], raw[:20]


def test_a_foreign_answer_is_shown_as_its_first_200_bytes_even_cut_inside_a_character() -> None:
    text = json.dumps("\u00e9" * 150, ensure_ascii=False).encode()  # a JSON string, not an error object
    assert read_error(text) == (None, '"' + "\u00e9" * 99 + "\ufffd")


# -- proofs: revocations, acknowledgements, used tokens (``_proofs``) -----------------------------------

IK = key("wm-invite")
INVITE = P.invite(IK, uses=2)
NODES = [key(f"wm-node-{i}") for i in range(3)]
JOINS = [P.join(INVITE, n, name=f"n{i}", at=10 + i, signer=IK) for i, n in enumerate(NODES)]


def _admit(join: Any, *, at: int | None = None, signer: Any = None, pool: Pool = P) -> Any:
    body = {"invite": INVITE.id, "join": join.id, "node": join["node"], "name": join["name"],
            "at": join["at"] if at is None else at}
    return sign("admit", pool.id, body, signer or pool.root)


def _revoke(node: str, *, signer: Any = None, pool: Pool = P) -> Any:
    return sign("revoke", pool.id, {"node": node, "keep": [], "at": 5}, signer or pool.root)


def test_a_root_signed_revocation_names_its_node_and_nothing_else_passes() -> None:
    node = JOINS[0]["node"]
    assert verify_revocation(P.id, _revoke(node).raw) == node
    member_signed = _revoke(node, signer=NODES[1])
    other_root = _revoke(node, pool=Q)
    for raw, why in [
        (member_signed.raw, "not a revocation signed by this pool's root key"),
        (other_root.raw, "not a revocation signed by this pool's root key"),
        (_admit(JOINS[0]).raw, "not a revocation signed by this pool's root key"),
        (b"not a record", "a revocation is not a valid record"),
        (_revoke(node).raw[:-3], "a revocation is not a valid record"),
    ]:
        with pytest.raises(ProofError, match=why):
            verify_revocation(P.id, raw)
    # The root of another pool, presenting its own revocation for its own pool, is believed there.
    assert verify_revocation(Q.id, other_root.raw) == node


def test_a_root_signed_acknowledgement_comes_back_as_its_record() -> None:
    admit = _admit(JOINS[0])
    assert verify_admit(P.id, admit.raw) == admit and verify_admit(P.id, admit.raw)["join"] == JOINS[0].id
    for raw, why in [
        (_admit(JOINS[0], signer=NODES[0]).raw, "not an acknowledgement of a join signed by this pool's root key"),
        (_admit(JOINS[0], pool=Q).raw, "not an acknowledgement of a join signed by this pool's root key"),
        (_revoke(JOINS[0]["node"]).raw, "not an acknowledgement of a join signed by this pool's root key"),
        (b"{}", "an acknowledgement of a join is not a valid record"),
    ]:
        with pytest.raises(ProofError, match=why):
            verify_admit(P.id, raw)


def test_a_token_is_used_up_only_once_all_its_uses_are_acknowledged_for_other_joins() -> None:
    first, second = _admit(JOINS[0], at=20), _admit(JOINS[1], at=30)
    assert token_used_by({}, INVITE, JOINS[2].id) is None
    assert token_used_by({first["join"]: first}, INVITE, JOINS[2].id) is None  # one of two uses left
    acked = {first["join"]: first, second["join"]: second}
    assert token_used_by(acked, INVITE, JOINS[2].id) == second  # the use taken last
    assert token_used_by(acked, INVITE, JOINS[0].id) is None  # an acknowledged join logs in
    assert token_used_by(acked, INVITE, JOINS[1].id) is None


def test_the_last_use_is_the_latest_acknowledgement_then_the_greatest_join_id() -> None:
    late_small, early_big = sorted([JOINS[0], JOINS[1]], key=lambda j: j.id)
    newer = _admit(late_small, at=50)
    older = _admit(early_big, at=40)
    assert token_used_by({older["join"]: older, newer["join"]: newer}, INVITE, JOINS[2].id) == newer
    same_a, same_b = _admit(late_small, at=60), _admit(early_big, at=60)  # a tie on time: the join id decides
    assert token_used_by({same_b["join"]: same_b, same_a["join"]: same_a}, INVITE, JOINS[2].id) == same_b
    assert token_used_by({same_a["join"]: same_a, same_b["join"]: same_b}, INVITE, JOINS[2].id) == same_b


def test_a_used_token_message_says_who_when_and_what_to_do() -> None:
    admit = _admit(JOINS[0], at=951_782_400 + 3600 + 120)  # 2000-02-29 01:02 UTC
    assert token_used_message(admit) == (
        "this token was already used by n0 at 2000-02-29 01:02 UTC; ask the pool admin for a new one ('ttpeer invite')")


@pytest.mark.parametrize("when", [
    "1970-01-01 00:00", "1970-01-31 01:00", "1970-03-31 23:59", "1972-02-29 12:00", "1972-03-01 00:00",
    "1999-12-31 23:59", "2000-02-28 10:00", "2000-02-29 01:00", "2000-03-01 00:00", "2000-12-31 13:37",
    "2024-02-29 01:59", "2099-12-31 23:00", "2100-02-28 22:00", "2100-03-01 00:01", "2200-03-01 03:00",
    "2400-02-29 01:00", "2400-03-01 00:00", "2500-03-01 00:00", "2514-08-31 09:09",
])
def test_the_time_a_token_was_used_is_right_on_every_calendar_edge(when: str) -> None:
    moment = int(datetime.datetime.strptime(when, "%Y-%m-%d %H:%M").replace(tzinfo=datetime.UTC).timestamp())
    assert utc_text(moment) == utc_text(moment + 59) == f"{when} UTC"


def test_a_broken_membership_proof_names_the_broken_link() -> None:
    node = NODES[0]
    join = JOINS[0]
    assert verify_proof(P.id, join["node"], [INVITE.raw, join.raw]).node == join["node"]
    q_invite = Q.invite(IK, uses=2)
    q_join = Q.join(q_invite, node, signer=IK)
    p_join_of_q_invite = P.join(q_invite, node, signer=IK)  # a pool-P join naming a pool-Q invite
    for proof, why in [
        ([INVITE.raw], "exactly \\[invite, join\\]"),
        ([INVITE.raw, join.raw, join.raw], "exactly \\[invite, join\\]"),
        ([INVITE.raw, b"junk"], "membership proof has a bad record"),
        ([q_invite.raw, q_join.raw], "for another pool"),
        ([INVITE.raw, q_join.raw], "for another pool"),  # only the join is of another pool
        ([q_invite.raw, p_join_of_q_invite.raw], "for another pool"),  # only the invite is
        ([INVITE.raw, P.join(INVITE, node, signer=NODES[1]).raw], "does not chain to a root-signed invite"),
        ([INVITE.raw, JOINS[1].raw], "for another node"),
    ]:
        with pytest.raises(ProofError, match=why):
            verify_proof(P.id, join["node"], proof)


# -- datasets: paths, urls, the manifest (``_dataset``) ------------------------------------------------


def test_a_dataset_path_is_1_to_512_characters_with_no_nul() -> None:
    assert path_problem("p" * 512) is None and path_problem("a/" + "p" * 510) is None
    assert path_problem("p" * 513) is not None
    for bad in ("a\x00b", "\x00", "a/\x00"):
        assert says(path_problem(bad), "a relative path"), repr(bad)


def test_a_dataset_names_one_to_four_urls_of_9_to_512_characters() -> None:
    assert urls_problem(["https://a"]) is None
    assert urls_problem([f"https://{i}.example" for i in range(4)]) is None
    assert urls_problem(["https://" + "u" * 504]) is None  # 512
    assert says(urls_problem(["https://" + "u" * 505]), "at most 512 characters")
    assert urls_problem(["https://a.example/\x7fok"]) is None  # only controls below 32 and spaces are refused
    assert urls_problem(["https://a.example/\x1f"]) is not None


def test_a_dataset_url_carries_no_user_but_may_have_an_at_sign_in_its_path() -> None:
    for bad in ("https://user@host.example/a/b/c", "https://user:pw@host.example", "https://u@h.example/x"):
        assert says(urls_problem([bad]), "must not carry a user or password"), bad
    assert urls_problem(["https://host.example/a@b"]) is None
    assert urls_problem(["https://host.example/x/y/a@b"]) is None


def test_a_dataset_lists_each_path_once_and_a_name_may_prefix_another_that_is_no_folder() -> None:
    body = dataset_body(files=[("a", 10), ("ab", 10), ("a.txt", 3)])
    assert refusal("dataset", body) is None
    dup = dataset_body(files=[("a", 10), ("b", 10)])
    dup["files"][1] = dict(dup["files"][0])  # the same path twice, the id recomputed to match
    dup["id"] = dataset_id(dup["piece_size"], record_files(dup))
    assert says(refusal("dataset", dup), "files must be sorted by path, each path once")


def test_a_tar_members_key_is_its_path_up_to_the_first_dot_of_its_base_name() -> None:
    assert tar_key("a/0001.jpg") == "a/0001"
    assert tar_key("0001.tar.gz") == "0001"
    assert tar_key("a.x/b.y/c.d.e") == "a.x/b.y/c"
    assert tar_key("plain") == "plain"
    assert tar_key("dir/plain") == "dir/plain"
    assert tar_key(".hidden") == ""


def test_a_sample_index_is_named_by_the_hash_of_its_canonical_bytes() -> None:
    index = {"format": "lines", "record": 0, "skip": [0], "counts": [3], "spill": [0]}
    expect = hashlib.sha256(b"ttpeer/samples/v1\n" + b'{"counts":[3],"format":"lines","record":0,"skip":[0],'
                            b'"spill":[0]}').hexdigest()
    assert samples_hash(index) == expect
    assert samples_hash(dict(reversed(list(index.items())))) == expect
    assert samples_hash({**index, "counts": [4]}) != expect


# -- datasets: the sample index of each format (``samples_problem``) ---------------------------------
# Pieces of 4096 bytes; unless a test says otherwise two files of 5000 and 10 bytes: pieces
# 0 and 1 are the first file's, piece 2 the second's.

TWO_FILES = [("a.bin", 5000), ("b.bin", 10)]


def index_refusal(samples: Any, files: list[tuple[str, int]] | None = None, piece_size: int = 4096) -> str | None:
    """Why ``sign`` refuses a dataset record over ``files`` with the sample index ``samples``."""
    body = dataset_body(files=TWO_FILES if files is None else files, piece_size=piece_size)
    return refusal("dataset", {**body, "samples": samples})


def lines(**over: Any) -> dict[str, Any]:
    return {"format": "lines", "record": 0, "skip": [0, 0], "counts": [3, 0, 1], "spill": [1, 0, 0], **over}


def test_a_lines_index_over_the_files_is_accepted_and_one_that_counts_no_sample_is_not() -> None:
    assert index_refusal(lines()) is None
    assert index_refusal(lines(counts=[0, 0, 1], spill=[0, 0, 0])) is None  # a single sample in all
    assert says(index_refusal(lines(counts=[0, 0, 0], spill=[0, 0, 0])), "must count at least one sample")


@pytest.mark.parametrize("samples", [
    5, [], "lines", ["format", "record", "skip", "counts", "spill"],
    {k: v for k, v in lines().items() if k != "spill"}, {**lines(), "extra": 1},
], ids=lambda s: repr(s)[:30])
def test_an_index_that_is_not_an_object_of_its_fields_is_refused(samples: Any) -> None:
    assert says(index_refusal(samples), "samples must have the fields ['counts', 'format', 'record', 'skip', 'spill']")


def test_an_index_of_an_unknown_format_or_with_another_formats_fields_is_refused() -> None:
    assert says(index_refusal(lines(format="csv")), "samples.format must be one of lines, records, npy, tar, parquet")
    for extra in ({"first": [0, 0, 0]}, {"dtype": "<f4", "shape": [1]}, {"groups": [0, 0, 0], "footer": [4, 4]}):
        assert says(index_refusal(lines(**extra)), "come with the npy format only"), extra


@pytest.mark.parametrize("record", [1, 0.0, False, "0", None, -1])
def test_a_lines_index_has_record_0_exactly(record: Any) -> None:
    assert says(index_refusal(lines(record=record)), "samples.record is 0 for lines")


def test_a_lines_piece_starts_at_most_piece_size_samples() -> None:
    assert index_refusal(lines(counts=[4096, 0, 1])) is None
    assert says(index_refusal(lines(counts=[4097, 0, 1])), "need one number per piece")


@pytest.mark.parametrize("over", [
    {"counts": [-1, 1, 1]}, {"counts": [1.0, 0, 1]}, {"counts": [True, 0, 1]}, {"counts": [1, 1]},
    {"counts": [1, 1, 1, 1]}, {"counts": "111"}, {"spill": [-1, 0, 0]}, {"spill": [0, 0]}, {"spill": [0.0, 0, 0]},
], ids=repr)
def test_counts_and_spill_are_one_whole_number_per_piece(over: dict[str, Any]) -> None:
    assert says(index_refusal(lines(**over)), "samples.counts and samples.spill need one number per piece"), over


def test_a_spill_may_reach_the_last_piece_of_its_file_and_no_further() -> None:
    forty_two = [("big.bin", 42 * 4096)]
    ok = {"format": "lines", "record": 0, "skip": [0], "counts": [1] + [0] * 41, "spill": [41] + [0] * 41}
    assert index_refusal(ok, forty_two) is None
    assert says(index_refusal({**ok, "spill": [42] + [0] * 41}, forty_two), "reach past file 'big.bin'")
    assert says(index_refusal(lines(spill=[0, 1, 0])), "reach past file 'a.bin'")
    assert says(index_refusal(lines(spill=[0, 0, 1])), "reach past file 'b.bin'")
    three = [*TWO_FILES, ("c.bin", 10)]
    spilled = lines(skip=[0, 0, 0], counts=[3, 0, 1, 1], spill=[0, 0, 0, 1])  # the third file's one piece
    assert says(index_refusal(spilled, three), "reach past file 'c.bin'")
    assert index_refusal({**spilled, "spill": [1, 0, 0, 0]}, three) is None


def test_skip_is_one_header_length_per_file_within_the_file_and_2_mib() -> None:
    assert index_refusal(lines(skip=[0, 10])) is None  # a file that is all header
    assert says(index_refusal(lines(skip=[0, 11])), "samples.skip or samples.spill reach past file 'b.bin'")
    for bad in ([-1, 0], [0], [0, 0, 0], [0.0, 0], "00"):
        assert says(index_refusal(lines(skip=bad)), "samples.skip needs one header length per file"), bad
    big = [("big.bin", 2**21)]
    at = {"format": "lines", "record": 0, "counts": [1, 1], "spill": [0, 0]}
    assert index_refusal({**at, "skip": [2**20]}, big, piece_size=2**20) is None
    assert says(index_refusal({**at, "skip": [2**20 + 1]}, big, piece_size=2**20), "one header length per file")


def records(**over: Any) -> dict[str, Any]:
    return {"format": "records", "record": 10, "skip": [0, 0], "counts": [409, 91, 1], "spill": [1, 0, 0], **over}


def test_a_records_index_has_files_of_whole_records_of_1_byte_to_a_piece() -> None:
    assert index_refusal(records()) is None
    assert index_refusal(records(record=1)) is None
    one_piece = [("r.bin", 8192)]
    whole = {"format": "records", "record": 4096, "skip": [0], "counts": [1, 1], "spill": [0, 0]}
    assert index_refusal(whole, one_piece) is None
    for bad in (4097, 0, -10, 10.0, True):
        assert says(index_refusal({**whole, "record": bad}, one_piece), "else the bytes of one sample"), bad
    assert says(index_refusal(records(record=7)), "file 'a.bin' is not a whole number of samples.record bytes")
    # The header is not samples: 5002 bytes after a 2-byte header are 625 records of 8.
    headed = [("h.bin", 5002)]
    assert index_refusal(records(record=8, skip=[2], counts=[512, 113], spill=[1, 0]), headed) is None
    assert index_refusal(records(record=8, skip=[0], counts=[512, 113], spill=[1, 0]), headed) is not None


def npy(**over: Any) -> dict[str, Any]:
    return {"format": "npy", "record": 24, "skip": [128, 10], "counts": [166, 37, 0], "spill": [1, 0, 0],
            "dtype": "<f4", "shape": [6], **over}


def test_an_npy_index_names_a_dtype_of_1_to_32_characters() -> None:
    assert index_refusal(npy()) is None
    for dtype in ("f", "<" + "x" * 31):
        assert index_refusal(npy(dtype=dtype)) is None, dtype
    for dtype in ("", "<" + "x" * 32, 5, None, ["<f4"]):
        assert says(index_refusal(npy(dtype=dtype)), "samples.dtype is a numpy type string"), dtype


def test_an_npy_row_shape_is_up_to_8_sizes_of_at_most_2_to_the_40() -> None:
    for shape in ([], [2**40], [1] * 8, [0, 3]):
        assert index_refusal(npy(shape=shape)) is None, shape
    for shape in ([-1], [2**40 + 1], [1] * 9, {}, "", "6", [6.0], None):
        assert says(index_refusal(npy(shape=shape)), "samples.shape the row's shape"), shape


def test_an_npy_index_comes_with_both_its_fields() -> None:
    without = {k: v for k, v in npy().items() if k != "shape"}
    assert says(index_refusal(without), "come with the npy format only")
    assert says(index_refusal({**npy(), "first": [0, 0, 0]}), "come with the npy format only")


def tar(**over: Any) -> dict[str, Any]:
    return {"format": "tar", "record": 0, "skip": [0, 0], "counts": [2, 1, 1], "spill": [1, 0, 0],
            "first": [0, 4608, 0], **over}


def test_a_tar_index_gives_one_offset_per_piece_up_to_2_to_the_50() -> None:
    assert index_refusal(tar()) is None
    assert index_refusal(tar(first=[0, 2**50, 0])) is None
    for first in ([0, 4608], [0, 4608, 0, 0], [-1, 4608, 0], [0, 2**50 + 1, 0], [0.0, 4608, 0], "0"):
        assert says(index_refusal(tar(first=first)), "samples.first needs one offset per piece"), first
    assert says(index_refusal(tar(record=512)), "samples.record is 0 for lines, tar")


# One parquet file of 12388 bytes: pieces 0-3, its footer at 12340 (so piece 3 holds row data
# too). Row group 0 starts in piece 0 and ends in piece 1; row group 1 starts in piece 2 and
# ends in piece 3, where the footer begins.
PARQUET_FILE = [("p.parquet", 3 * 4096 + 100)]


def parquet(**over: Any) -> dict[str, Any]:
    return {"format": "parquet", "record": 0, "skip": [0], "counts": [10**6, 0, 500, 0], "spill": [1, 0, 1, 0],
            "groups": [0, 0, 1, 0], "footer": [12340], **over}


def parquet_refusal(**over: Any) -> str | None:
    return index_refusal(parquet(**over), PARQUET_FILE)


def test_a_parquet_index_is_accepted_and_its_pieces_may_start_more_rows_than_they_have_bytes() -> None:
    assert parquet_refusal() is None
    assert parquet_refusal(counts=[2**32, 0, 500, 0]) is None
    assert parquet_refusal(counts=[2**32 + 1, 0, 500, 0]) is not None


def test_a_parquet_footer_lies_after_the_magic_bytes_and_before_the_last_8() -> None:
    lone_group = {"counts": [5, 0, 0, 0], "spill": [0, 0, 0, 0], "groups": [0, 0, 0, 0]}
    assert parquet_refusal(footer=[4], **lone_group) is None
    assert parquet_refusal(footer=[12380]) is None  # 12388 - 8
    for footer in (3, 12381, 13000):
        assert says(parquet_refusal(footer=[footer], **lone_group), "of file 'p.parquet' must lie inside"), footer
    for footer in ([], [12340, 12340], [-1], [12340.0]):
        assert says(parquet_refusal(footer=footer), "samples.footer needs one offset per file"), footer


def test_a_parquet_row_group_reaches_no_piece_where_only_the_footer_lies() -> None:
    assert parquet_refusal(footer=[3 * 4096 + 1]) is None  # one byte of row data in piece 3
    assert says(parquet_refusal(footer=[3 * 4096]), "file 'p.parquet': a row group reaches past the file's row data")


def test_parquet_row_groups_follow_one_another_without_overlapping() -> None:
    # The next group may start in the piece where the last one ends...
    assert parquet_refusal(counts=[10, 5, 0, 0], spill=[1, 0, 0, 0], groups=[0, 1, 0, 0]) is None
    overlap = "file 'p.parquet': its row groups overlap"
    # ...not in a piece the last one spans past, nor with a number not after the last one's.
    assert says(parquet_refusal(counts=[10, 5, 0, 0], spill=[2, 0, 0, 0], groups=[0, 1, 0, 0]), overlap)
    assert says(parquet_refusal(counts=[10, 5, 0, 0], spill=[0, 0, 0, 0], groups=[0, 0, 0, 0]), overlap)
    assert says(parquet_refusal(counts=[10, 0, 5, 0], spill=[0, 0, 0, 0], groups=[3, 0, 2, 0]), overlap)


def test_a_parquet_piece_where_no_row_group_starts_has_no_spill_and_no_group() -> None:
    why = "samples.spill and samples.groups are 0 for a piece where no row group starts"
    assert says(parquet_refusal(spill=[1, 1, 1, 0]), why)
    assert says(parquet_refusal(groups=[0, 7, 1, 0]), why)


def test_a_parquet_index_has_one_group_number_per_piece_and_no_header() -> None:
    for groups in ([0, 0, 1], [0, 0, 1, 0, 0], [0.0, 0, 1, 0], [0, 0, 2**32 + 1, 0]):
        assert says(parquet_refusal(groups=groups), "samples.groups needs one row group number per piece"), groups
    assert parquet_refusal(groups=[0, 0, 2**32, 0]) is None
    assert says(parquet_refusal(skip=[4]), "samples.skip is 0 for each parquet file")


def test_parquet_files_are_checked_each_against_its_own_pieces() -> None:
    two = [("p.parquet", 3 * 4096 + 100), ("q.parquet", 4096 + 100)]  # pieces 0-3, then 4-5
    ok = parquet(skip=[0, 0], counts=[10**6, 0, 500, 0, 7, 0], spill=[1, 0, 1, 0, 1, 0], groups=[0, 0, 1, 0, 0, 0],
                 footer=[12340, 4150])
    assert index_refusal(ok, two) is None
    assert says(index_refusal({**ok, "footer": [12340, 4096]}, two), "file 'q.parquet': a row group reaches past")


# -- records: a job's cross-field rules, members, datasets (``_records``) ---------------------------

MEMBER = {"seed": 1, "lr": 0.01, "weight_decay": 0.0}


ENSEMBLE = {"mode": "ensemble", "shards": 2, "members": [dict(MEMBER, seed=i) for i in range(2)]}


def one_member(**member: Any) -> dict[str, Any]:
    """A valid ensemble job of one shard whose member has ``member``'s fields."""
    return job_body(mode="ensemble", shards=1, members=[dict(MEMBER, **member)])


# (what changes from a valid fused job of 3 rounds x 2 inner steps, batch 8; why it is refused, or None)
JOB_RULES: list[tuple[dict[str, Any], str | None]] = [
    ({"overlap": 1}, None),
    ({"overlap": 0, **ENSEMBLE}, None),
    ({"overlap": 1, **ENSEMBLE}, "only a fused job overlaps rounds"),
    ({"micro_batch": 8}, None),
    ({"micro_batch": 9}, "micro_batch (9) must not exceed batch_size (8)"),
    ({"rounds": 1, "batches": 1}, None),
    ({"warmup": 5}, None),
    ({"warmup": 6}, "warmup (6 steps) must be shorter than the job (6 inner steps"),
    ({"warmup": 0, "rounds": 1, "batches": 1}, None),
    ({"outer_warmup": 2}, None),
    ({"outer_warmup": 3}, "outer_warmup (3 rounds) must be shorter than the job (3 rounds)"),
    ({"h_min": 1, "h_max": 4}, None),
    ({"h_min": 2, "h_max": 2}, None),
    ({"h_min": 1}, "gives both h_min and h_max"),
    ({"h_max": 4}, "gives both h_min and h_max"),
    ({"h_min": 3, "h_max": 4}, "must lie within h_min..h_max (3..4)"),
    ({"h_min": 1, "h_max": 1}, "must lie within h_min..h_max (1..1)"),
    ({"h_min": 1, "h_max": 4, **ENSEMBLE}, "only a fused job picks its inner steps per round"),
    ({"h_min": 1, "h_max": 4, "outer_lr_schedule": "constant"}, None),
    ({"h_min": 1, "h_max": 4, "outer_lr_schedule": "cosine"}, "an outer-lr schedule is laid over a fixed number"),
    ({"chunk": 4096}, None),
    ({"chunk": 2**21, "slice_bits": 4}, None),
    ({"chunk": 4096 + 2048}, "chunk (6144) must be a power of two"),
    ({"chunk": 4096, **ENSEMBLE}, "only a fused job reduces its rounds in slices"),
    ({"slice_bits": 4}, "slice_bits goes with chunk"),
    ({"chunk": 4096, "slice_min": 1 << 20}, None),
    ({"chunk": 4096, "slice_min": 0}, None),
    ({"slice_min": 1 << 20}, "slice_min goes with chunk"),
    ({"holdout": 0, **ENSEMBLE}, None),
    ({"holdout": 5}, "only an ensemble job holds samples out"),
    ({"outer_auto": 1}, None),
    ({"outer_auto": 1, "outer_lr_schedule": "constant"}, None),
    ({"outer_auto": 1, **ENSEMBLE}, "only a fused job has an outer step to pick"),
    ({"outer_auto": 1, "outer_lr_schedule": "linear"}, "outer_auto picks each round's outer lr"),
    ({"outer_lr_schedule": "linear"}, None),
    ({"params": 10, "trainable": 10}, None),
    ({"params": 10, "trainable": 3}, None),
    ({"params": 10}, "params and trainable go together"),
    ({"trainable": 10}, "params and trainable go together"),
    ({"params": 10, "trainable": 11}, "params and trainable go together"),
    ({"datasets": {"a": hex64(1), "b": hex64(2)}, "samples": {"a": hex64(3)}}, None),
    ({"datasets": {"a": hex64(1)}, "samples": {"a": hex64(3)}}, None),
    ({"datasets": {"a": hex64(1)}, "samples": {"b": hex64(3)}}, "samples names a dataset that datasets does not"),
    ({"samples": {"a": hex64(3)}}, "samples names a dataset that datasets does not"),
    ({**ENSEMBLE, "shards": 1, "members": [MEMBER]}, None),
    ({**ENSEMBLE, "shards": 3}, "an ensemble job must list exactly one member per shard"),
    ({**ENSEMBLE, "members": "x"}, "invalid 'members'"),
    ({"members": [MEMBER] * 4}, "only an ensemble job lists members"),
]


@pytest.mark.parametrize(("over", "why"), JOB_RULES,
                         ids=[",".join(f"{k}={str(v)[:8]}" for k, v in o.items()) for o, _ in JOB_RULES])
def test_a_jobs_fields_agree_with_each_other(over: dict[str, Any], why: str | None) -> None:
    problem = refusal("job", job_body(**over))
    if why is None:
        assert problem is None
    else:
        assert says(problem, why), problem


def test_an_ensemble_members_seed_lr_and_weight_decay_are_bounded() -> None:
    for member in ({"seed": 0}, {"seed": 2**31}, {"lr": 10}, {"lr": 1e-9}, {"weight_decay": 10},
                   {"weight_decay": 0}):
        assert refusal("job", one_member(**member)) is None, member
    for member in ({"seed": 2**31 + 1}, {"seed": 2**40}, {"lr": 10.5}, {"lr": 0}, {"weight_decay": 10.5},
                   {"seed": 1.0}, {"lr": "0.1"}):
        assert says(refusal("job", one_member(**member)), "invalid 'members'"), member


def test_a_job_names_1_to_64_datasets() -> None:
    names = {f"d{i}": hex64(i) for i in range(65)}
    assert refusal("job", job_body(datasets=dict(list(names.items())[:64]))) is None
    assert says(refusal("job", job_body(datasets=names)), "invalid 'datasets'")


def test_a_dataset_may_hold_an_empty_file() -> None:
    body = dataset_body(files=[("empty", 0), ("full", 5)])
    assert refusal("dataset", body) is None and [f["pieces"] for f in body["files"]][0] == []


def test_distinct_records_hash_apart_and_a_record_hashes_as_its_id() -> None:
    recs = [sign("cancel", P.id, {"job": hex64(i), "at": i}, AUTHOR) for i in range(8)]
    assert len({hash(r) for r in recs}) == 8
    assert all(hash(r) == hash(r.id) for r in recs)


CLOSE = valid_bodies()["close"]


def test_a_close_weighs_members_by_whole_numbers_up_to_10000_not_all_zero() -> None:
    for weights in ([0, 1], [10_000], [0] * 4095 + [1]):
        assert refusal("close", dict(CLOSE, weights=weights)) is None, weights[:3]
    for weights in ([], [0, 0], [-1, 2], [10_001], [1.0], [True], ["1"], "1", [1] * 4097):
        assert says(refusal("close", dict(CLOSE, weights=weights)), "invalid 'weights'"), weights[:3]


def test_a_close_names_its_slices_in_slice_order_repeats_allowed() -> None:
    for slices in ([hex64(1)], [hex64(2), hex64(1), hex64(2)]):
        assert refusal("close", dict(CLOSE, slices=slices)) is None
    for slices in ([], hex64(1), [hex64(1).upper()], [hex64(1)[:-2]], [state(1)], [None]):
        assert says(refusal("close", dict(CLOSE, slices=slices)), "invalid 'slices'"), slices


def test_lists_and_texts_reach_their_caps_exactly() -> None:
    contrib = valid_bodies()["contrib"]
    assert refusal("contrib", dict(contrib, shards=list(range(4096)))) is None
    assert refusal("contrib", dict(contrib, shards=[4095])) is None
    assert refusal("contrib", dict(contrib, metrics={f"m{i}": i for i in range(16)})) is None
    assert refusal("job", job_body(task="t" * 256)) is None
    decline = valid_bodies()["decline"]
    assert refusal("decline", dict(decline, reason="r" * 1000)) is None
    assert says(refusal("decline", dict(decline, reason=7)), "invalid 'reason'")
