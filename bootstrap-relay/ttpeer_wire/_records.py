"""Signed records: the only facts peers agree on.

A record is ``{"v", "kind", "pool", "author", "body", "sig"}`` in canonical
encoding. ``sig`` is the author's Ed25519 signature over the same object without
``sig``, prefixed by a domain string so a record signature can never be confused
with any other signature ttpeer makes. The record id is the sha256 of the full
canonical bytes; records are held in sets keyed by id, so duplicates collapse.

``parse`` is the only way bytes from outside become a ``Record``: size cap,
canonical form, schema of the kind, then the signature. Which author may write
which kind (the root signs invites and revocations, an invite key signs joins,
members sign the rest) is judged by the views, because it depends on other records.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from . import _codec
from ._dataset import MAX_DATASET_FILES, MAX_PIECE_SIZE, MIN_PIECE_SIZE, dataset_consistent, path_problem
from ._errors import RecordError
from ._netfields import certificate, direct_addrs, relay_list

VERSION = 1
MAX_RECORD_BYTES = 64 * 1024
_SIGN_DOMAIN = b"ttpeer/record/v1\n"

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_STATE = re.compile(r"^sha256:[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def pool_id_of(root_public: str) -> str:
    """The pool id: a hash of the root public key (hex), 32 hex characters."""
    return hashlib.sha256(b"ttpeer/pool/v1\n" + bytes.fromhex(root_public)).hexdigest()[:32]


def public_hex(key: Ed25519PrivateKey) -> str:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


# -- field validators ---------------------------------------------------------------

Validator = Callable[[Any], bool]


def _int(lo: int = 0, hi: int = 2**53) -> Validator:
    return lambda v: type(v) is int and lo <= v <= hi


def _num(lo: float, hi: float) -> Validator:
    return lambda v: type(v) in (int, float) and lo <= v <= hi


def _re(pattern: re.Pattern[str]) -> Validator:
    return lambda v: type(v) is str and pattern.fullmatch(v) is not None


def _str(max_len: int) -> Validator:
    return lambda v: type(v) is str and len(v) <= max_len


def _choice(*options: str | int | bool) -> Validator:
    return lambda v: any(type(v) is type(o) and v == o for o in options)


def _sorted_unique(item: Validator, max_len: int, min_len: int = 0) -> Validator:
    def check(v: Any) -> bool:
        return (
            type(v) is list
            and min_len <= len(v) <= max_len
            and all(item(x) for x in v)
            and all(a < b for a, b in zip(v, v[1:], strict=False))
        )

    return check


def _hex_list(max_len: int) -> Validator:
    """A list of record ids in the order given (repeats allowed: one per slot)."""
    return lambda v: type(v) is list and 1 <= len(v) <= max_len and all(_HEX(x) for x in v)


def _int_list(max_len: int) -> Validator:
    """1..``max_len`` whole numbers from 0 to 10,000, not all 0 (an ensemble's vote weights)."""
    return lambda v: (type(v) is list and 1 <= len(v) <= max_len and all(type(x) is int and 0 <= x <= 10_000
                                                                          for x in v) and any(v))


def _metrics(v: Any) -> bool:
    return (
        type(v) is dict
        and len(v) <= 16
        and all(type(k) is str and _NAME.fullmatch(k) and type(x) in (int, float) for k, x in v.items())
    )


def _member_list(v: Any) -> bool:
    member = {"seed": _int(0, 2**31), "lr": _num(1e-9, 10), "weight_decay": _num(0, 10)}
    return (
        type(v) is list
        and 1 <= len(v) <= 4096
        and all(type(m) is dict and set(m) == set(member) and all(member[k](m[k]) for k in member) for m in v)
    )


def _anything(v: Any) -> bool:
    """A field whose rules span others: its kind's ``CHECKS`` entry checks it."""
    return True


def _dataset_files(v: Any) -> bool:
    """A dataset record's files: ``{path, size, pieces: [[piece hash, blob], ...]}`` each."""
    def piece(p: Any) -> bool:
        return type(p) is list and len(p) == 2 and all(_HEX(x) for x in p)

    return (
        type(v) is list
        and 1 <= len(v) <= MAX_DATASET_FILES
        and all(type(f) is dict and set(f) == {"path", "size", "pieces"} and path_problem(f["path"]) is None
                and _int(0, 2**50)(f["size"]) and type(f["pieces"]) is list and all(map(piece, f["pieces"]))
                for f in v)
    )


def _datasets(v: Any) -> bool:
    """A job's datasets: the name its task asked for -> that dataset's id."""
    return (type(v) is dict and 1 <= len(v) <= 64
            and all(_re(_NAME)(k) and _HEX(x) for k, x in v.items()))


def _job_consistent(body: dict[str, Any]) -> str | None:
    """Cross-field rules of a job: an ensemble lists one member per shard, fused lists none;
    a micro-batch fits in the batch; the lr warm-ups (inner, outer) end before the job does."""
    if body["mode"] == "ensemble":
        if "members" not in body or len(body["members"]) != body["shards"]:
            return "an ensemble job must list exactly one member per shard"
    elif "members" in body:
        return "only an ensemble job lists members"
    if body.get("overlap") and body["mode"] != "fused":
        return "only a fused job overlaps rounds"
    if body.get("micro_batch", 0) > body["batch_size"]:
        return f"micro_batch ({body['micro_batch']}) must not exceed batch_size ({body['batch_size']})"
    steps = body["rounds"] * body["batches"]
    if body.get("warmup", 0) >= steps:
        return (f"warmup ({body['warmup']} steps) must be shorter than the job ({steps} inner steps: "
                "rounds x inner steps)")
    if body.get("outer_warmup", 0) >= body["rounds"]:
        return f"outer_warmup ({body['outer_warmup']} rounds) must be shorter than the job ({body['rounds']} rounds)"
    if ("h_min" in body) != ("h_max" in body):
        return "an auto-cadence job gives both h_min and h_max"
    if "h_min" in body:
        if body["mode"] != "fused":
            return "only a fused job picks its inner steps per round"
        if not body["h_min"] <= body["batches"] <= body["h_max"]:
            return (f"the first rounds' inner steps ({body['batches']}) must lie within "
                    f"h_min..h_max ({body['h_min']}..{body['h_max']})")
        if body.get("outer_lr_schedule", "constant") != "constant":
            return ("an outer-lr schedule is laid over a fixed number of rounds: give fixed inner steps "
                    "(an auto-cadence job's round count follows its link)")
    if "chunk" in body:
        if body["mode"] != "fused":
            return "only a fused job reduces its rounds in slices (chunk)"
        if body["chunk"] & (body["chunk"] - 1):
            return f"chunk ({body['chunk']}) must be a power of two"
    elif "slice_bits" in body or "slice_min" in body:
        field = "slice_bits" if "slice_bits" in body else "slice_min"
        return f"{field} goes with chunk (a job that reduces its rounds in slices)"
    if "holdout" in body and body["mode"] != "ensemble":
        return "only an ensemble job holds samples out"
    if body.get("outer_auto"):
        if body["mode"] != "fused":
            return "only a fused job has an outer step to pick"
        if body.get("outer_lr_schedule", "constant") != "constant":
            return "outer_auto picks each round's outer lr: a job with an outer-lr schedule gives its own"
    if ("params" in body) != ("trainable" in body) or body.get("trainable", 0) > body.get("params", 0):
        return "params and trainable go together, and no more parameters train than the model has"
    if "samples" in body and not set(body["samples"]) <= set(body.get("datasets") or ()):
        return "samples names a dataset that datasets does not"
    return None


_HEX = _re(_HEX64)
# A contribution's ``precision`` metric: how its peer autocast (metrics carry numbers only).
PRECISION_CODES = {"fp32": 32, "bf16": 16, "fp16": 15}
MAX_KEEP = 900  # record ids a revocation can keep: 900 x 67 bytes stays under the record cap
_STATE_HASH = _re(_STATE)

# The table of kinds: every field, and nothing else, must be present and valid.
SCHEMAS: dict[str, dict[str, Validator]] = {
    "invite": {"key": _HEX, "expires": _int(), "uses": _int(1, 10_000), "role": _choice("member", "admin")},
    "join": {"invite": _HEX, "node": _HEX, "seal": _HEX, "name": _re(_NAME), "at": _int()},
    "job": {
        "task": _str(256), "task_hash": _HEX, "task_blob": _re(re.compile(r"^([0-9a-f]{64})?$")),
        # ``batches``: a round's inner steps per shard (``inner_steps`` in code, ``--inner-steps``).
        "mode": _choice("fused", "ensemble"), "rounds": _int(1, 100_000),
        "shards": _int(1, 4096), "batches": _int(1, 1_000_000), "batch_size": _int(1, 65536),
        "inner_lr": _num(0, 10), "weight_decay": _num(0, 10), "outer_lr": _num(0, 10),
        "outer_momentum": _num(0, 1), "bits": _choice(4, 8), "seed": _int(0, 2**31),
        "init": _STATE_HASH, "init_blob": _HEX, "lease": _num(1, 86_400), "steal": _choice(True, False),
        "at": _int(),
        # Ensemble jobs only (OPTIONAL): one entry per member, its seed and hyper-parameter
        # variant; the member index is the shard index and a round is one unit of training.
        "members": _member_list,
        # Fused jobs only (OPTIONAL): 1 = round r trains on the state before round r-1's close
        # (a one-round-delayed outer step), so a round's delta travels while the next trains.
        "overlap": _choice(0, 1),
        # How inner steps run (OPTIONAL, train/_recipe.py). ``precision``: autocast dtype of
        # forward/backward, absent = each peer picks; ``micro_batch``: forces every peer's
        # micro-batch, absent = each picks from its memory; ``checkpointing``: 1 = activation
        # checkpointing; the lr of global inner step s is inner_lr x the schedule's factor(s).
        "precision": _choice("fp32", "bf16", "fp16"), "micro_batch": _int(1, 65536),
        "checkpointing": _choice(0, 1), "lr_schedule": _choice("constant", "cosine", "linear"),
        "warmup": _int(0, 2**40), "final_lr_ratio": _num(0, 1),
        "outer_lr_schedule": _choice("constant", "cosine", "linear"), "outer_warmup": _int(0, 2**40),
        "outer_final_lr_ratio": _num(0, 1),
        # OPTIONAL: sha256 over the task's dataset sizes and a fixed sample of its items, as
        # the submitter built them; a peer whose copy differs declines (code "data").
        "data": _HEX,
        # OPTIONAL (default 600): seconds one training step may take before the worker
        # running it is judged hung and the job fails on that peer.
        "step_timeout": _num(1, 7 * 86_400),
        # Fused jobs only (OPTIONAL, both or neither): the pool picks each round's inner steps
        # per shard within h_min..h_max (proto/_cadence.py); the budget stays rounds x batches
        # inner steps per shard, and ``batches`` is the first two rounds' size.
        "h_min": _int(1, 1_000_000), "h_max": _int(1, 1_000_000),
        # OPTIONAL: the datasets its task read through ``ttpeer.train.dataset_path``, by the
        # name it asked for, as resolved where the job was submitted (``dataset`` records).
        "datasets": _datasets,
        # OPTIONAL: of those, the ones read sample by sample (``dataset_samples``), by name,
        # with the hash of the sample index the submitter read them through
        # (``ttpeer_wire.samples_hash``): every peer reads the same index.
        "samples": _datasets,
        # Fused jobs only (OPTIONAL): deltas are chunked (``TTD2``) in runs of ``chunk``
        # values, a power of two, and a round of three or more contributors is reduced in
        # aggregation slices (``proto/_slicer.py``): each peer reduces a slice of the mean,
        # everyone downloads the reduced slices. Absent: every peer downloads every delta.
        # A peer of a version without slices drops the record (its field is unknown).
        "chunk": _int(4096, 2**21),
        # With chunk (OPTIONAL, default 8): the bits a reduced slice is re-quantized to
        # (``train.encode_slice``). Every reducer and checker encodes with it, so a slice's
        # bytes, and its hash, are the same everywhere.
        "slice_bits": _choice(3, 4, 8),
        # With chunk (OPTIONAL): a round is reduced in slices only when that saves each peer
        # this many bytes of download or more (``proto/_slices.pays``, from the
        # contributions' sizes); below it, the reduction's extra round trips cost more than
        # the bytes: the round closes from all deltas. Absent: from 3 authors, whatever the size.
        # A peer of a version without it drops the record (its field is unknown).
        "slice_min": _int(0, 2**40),
        # Fused jobs only (OPTIONAL): 1 = each close picks its outer lr and momentum from the
        # round (its contributions and inner steps, ``proto/_outer.py``) and names them;
        # ``outer_lr`` and ``outer_momentum`` above are then only where the first round starts.
        # 2 = the same, the momentum scaled by how far the round before's deltas agreed (its
        # close's ``mean_sq`` and its contributions' ``delta_sq`` metric). A peer of a version
        # that predates outer_auto 2 drops such a job (the value is unknown to it).
        "outer_auto": _choice(1, 2),
        # Ensemble jobs only (OPTIONAL): training samples no member trains on, drawn by the
        # job's seed; each close weighs the members by their vote on them (train/_select.py).
        "holdout": _int(0, 2**31),
        # OPTIONAL, both or neither: the model's parameters, and how many of them train (fewer
        # with adapters over a frozen base); what status and submit print, checked by nobody.
        "params": _int(1, 2**50),
        "trainable": _int(1, 2**50),
    },
    # A claim with n > 0 renews the lease of claim n=0; ``done`` batches so far at ``rate``
    # batches/s let others project when it will finish. ``backup``: a copy run by an idle
    # peer against a straggler; it never takes the shard from its owner.
    "claim": {
        "job": _HEX, "round": _int(), "shard": _int(0, 4095), "attempt": _int(0, 10_000), "n": _int(),
        "done": _int(), "rate": _num(0, 1e9), "backup": _choice(True, False),
    },
    "release": {"job": _HEX, "round": _int(), "shard": _int(0, 4095), "attempt": _int(0, 10_000)},
    "contrib": {
        "job": _HEX, "round": _int(), "base": _STATE_HASH, "shards": _sorted_unique(_int(0, 4095), 4096, 1),
        "samples": _int(1, 2**40), "blob": _HEX, "size": _int(1, 2**40), "metrics": _metrics,
        # Sliced jobs only (OPTIONAL): the chunks of its ``TTD2`` delta, each sealed as its
        # own piece (``seal_cut``: the head, then one piece per chunk).
        "chunks": _int(1, 65536),
    },
    "close": {
        "job": _HEX, "round": _int(), "base": _STATE_HASH, "contribs": _sorted_unique(_HEX, 4096, 1),
        "state": _STATE_HASH, "metrics": _metrics,
        # Overlapped jobs only (OPTIONAL): the state the contributions trained on, which is
        # the base of the round before; the outer step applies their average to ``base``.
        "tbase": _STATE_HASH,
        # Auto-cadence jobs only (OPTIONAL): the inner steps per shard of round ``round`` + 2,
        # picked by this close from its contributions' figures (proto/_cadence.py).
        "next": _int(1, 1_000_000),
        # Sliced rounds only (OPTIONAL): the ``slice`` records whose reduced slices, in
        # slice order, make the round's mean (``proto/_slicer.py``).
        "slices": _hex_list(4096),
        # Jobs with outer_auto only (OPTIONAL, both or neither): the outer step this close took;
        # every peer that applies it takes the same.
        "outer_lr": _num(0, 10), "outer_momentum": _num(0, 1),
        # Jobs with outer_auto 2 only (OPTIONAL): the energy (sum of squares) of the mean this
        # close applied, which the next close weighs against the contributions' ``delta_sq``.
        "mean_sq": _num(0, 1e300),
        # Ensemble jobs only (OPTIONAL): how many times each member counts in the vote.
        "weights": _int_list(4096),
    },
    # One reduced slice of a round's mean: chunks ``first`` .. ``stop``-1 of the mean of the
    # contributions ``contribs`` (the close's), slice ``slice`` of ``of``, re-quantized; its
    # plaintext hashes to ``sha256``. ``blob`` holds it sealed; a check that reproduced
    # another's result names that one's blob.
    "slice": {"job": _HEX, "round": _int(), "base": _STATE_HASH, "contribs": _sorted_unique(_HEX, 4096, 1),
              "slice": _int(0, 4095), "of": _int(1, 4096), "first": _int(0, 65535), "stop": _int(1, 65536),
              "blob": _HEX, "sha256": _HEX, "size": _int(1, 2**40)},
    "ckpt": {"job": _HEX, "round": _int(), "state": _STATE_HASH, "blob": _HEX, "size": _int(1, 2**40)},
    # A member asks for a checkpoint of ``state`` (a state of the job's chain) rather than
    # replay the deltas up to it: a peer that holds it publishes one (``proto/_closer.py``).
    # Fused jobs publish checkpoints only when asked: no model is sent that nobody needs.
    "ckpt_want": {"job": _HEX, "state": _STATE_HASH},
    # Root-signed: ``node`` is no longer a member. Of its records only those named in
    # ``keep`` (by id: the jobs, contributions, closes and checkpoints the pool's chains
    # already rest on) still count; anything else it signed, before or after, is ignored.
    # ``at`` is the admin's wall time, shown to people and judged by nobody.
    "revoke": {"node": _HEX, "keep": _sorted_unique(_HEX, MAX_KEEP), "at": _int()},
    # Root-signed: the admin saw the join ``join`` (of ``invite``, by ``node``) and counts it
    # for one of the invite's uses. An acknowledged join beats any that is not, and an invite
    # whose uses are all acknowledged admits nobody more (``proto/_membership.py``).
    # ``name`` and ``at`` repeat the join's, so that a relay can say who used a token.
    "admit": {"invite": _HEX, "join": _HEX, "node": _HEX, "name": _re(_NAME), "at": _int()},
    # A peer sits a job out, and says why; ``need`` and ``have``: bytes of memory, both 0
    # when the reason is not memory (e.g. its copy of the task differs).
    # ``code`` (OPTIONAL; absent in older records): what kind of reason, for machines (see
    # ``_outcome.DECLINE_CODES``); "failed" is for good: the task's code failed on this peer.
    "decline": {"job": _HEX, "reason": _str(1000), "need": _int(), "have": _int(),
                "code": _re(re.compile(r"^[a-z]{1,16}$"))},
    # The job's submitter or an admin member ends a job for the whole pool; anyone else's
    # cancel is ignored by the views (``_outcome``). ``at``: the author's wall time, shown only.
    "cancel": {"job": _HEX, "at": _int()},
    # Files a member added (``ttpeer data add``), cut into pieces (ttpeer_wire/_dataset.py):
    # ``id`` is the hash of the manifest (paths, sizes, piece hashes, piece size) alone;
    # each piece is ``[its sha256, the blob that holds it sealed]``.
    # OPTIONAL ``samples`` (a sample index, for ``dataset_samples``) and ``urls`` (https
    # addresses serving the files too): checked in ``dataset_consistent``.
    "dataset": {"name": _re(_NAME), "id": _HEX, "piece_size": _int(MIN_PIECE_SIZE, MAX_PIECE_SIZE),
                "files": _dataset_files, "at": _int(), "samples": _anything, "urls": _anything},
    # Withdraws the dataset record ``dataset`` (by record id); counts when signed by that
    # record's author or an admin member (``proto.live_datasets``).
    "dataset_rm": {"dataset": _HEX, "at": _int()},
    # A member serves blobs (dataset pieces) to the others directly, over TLS with the
    # certificate ``cert`` (hex DER, which the fetcher pins), at any of ``addrs``; peers
    # that cannot reach them fetch through the relay as before. The newest one counts.
    "direct": {"addrs": direct_addrs, "cert": certificate, "at": _int()},
    # Root-signed: the pool's relays, each with its certificate's fingerprint, in the order
    # peers prefer them (the first live one carries the blobs). The highest ``n`` counts;
    # ``at`` is the admin's wall time, shown only. Anyone else's is ignored (``proto.pool_relays``).
    "relays": {"relays": relay_list, "n": _int(1), "at": _int()},
}


# Fields a body may leave out (added after records of that kind were already in use, so
# older records stay valid byte for byte), and rules that span several fields.
OPTIONAL: dict[str, frozenset[str]] = {
    "job": frozenset({"members", "overlap", "precision", "micro_batch", "checkpointing", "lr_schedule", "warmup",
                      "final_lr_ratio", "data", "step_timeout", "outer_lr_schedule", "outer_warmup",
                      "outer_final_lr_ratio", "h_min", "h_max", "datasets", "samples", "chunk",
                      "slice_bits", "slice_min", "outer_auto", "holdout", "params", "trainable"}),
    "close": frozenset({"tbase", "next", "slices", "outer_lr", "outer_momentum", "weights", "mean_sq"}),
    "contrib": frozenset({"chunks"}),
    "dataset": frozenset({"samples", "urls"}),
    "decline": frozenset({"code"}),
}
CHECKS: dict[str, Callable[[dict[str, Any]], str | None]] = {
    "job": _job_consistent, "dataset": dataset_consistent,
    "slice": lambda b: None if b["first"] < b["stop"] and b["slice"] < b["of"] else
    "a slice holds chunks first < stop and is one of 'of' slices",
    "close": lambda b: None if ("outer_lr" in b) == ("outer_momentum" in b) else
    "a close names both outer_lr and outer_momentum, or neither",
}


@dataclass(frozen=True, eq=False)
class Record:
    """A verified record. Equality and hashing go by ``id`` (the hash of its bytes)."""

    kind: str
    pool: str
    author: str
    body: Mapping[str, Any]
    sig: str
    raw: bytes
    id: str

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Record) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __getitem__(self, field: str) -> Any:
        return self.body[field]


def _signed_part(kind: str, pool: str, author: str, body: Mapping[str, Any]) -> bytes:
    unsigned = {"v": VERSION, "kind": kind, "pool": pool, "author": author, "body": dict(body)}
    return _SIGN_DOMAIN + _codec.encode(unsigned)


def _check_body(kind: str, body: Any) -> None:
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise RecordError(f"unknown record kind {kind!r}")
    optional = OPTIONAL.get(kind, frozenset())
    if type(body) is not dict or not set(schema) - optional <= set(body) <= set(schema):
        raise RecordError(f"{kind} record has the wrong fields")
    for field, valid in schema.items():
        if field in body and not valid(body[field]):
            raise RecordError(f"{kind} record has an invalid {field!r}")
    check = CHECKS.get(kind)
    problem = check(body) if check is not None else None
    if problem is not None:
        raise RecordError(f"{kind} record: {problem}")


def sign(kind: str, pool: str, body: Mapping[str, Any], key: Ed25519PrivateKey) -> Record:
    """Make a record of ``kind`` for ``pool`` signed by ``key``. Raises ``RecordError``."""
    _check_body(kind, dict(body))
    if not _HEX32.match(pool):
        raise RecordError("pool id must be 32 hex characters")
    author = public_hex(key)
    sig = key.sign(_signed_part(kind, pool, author, body)).hex()
    full = {"v": VERSION, "kind": kind, "pool": pool, "author": author, "body": dict(body), "sig": sig}
    raw = _codec.encode(full)
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError(f"{kind} record would be {len(raw)} bytes, over the cap")
    # The record's body is decoded from its own bytes, so it shares nothing with the caller.
    return Record(kind, pool, author, json.loads(raw)["body"], sig, raw, hashlib.sha256(raw).hexdigest())


_PARSED: OrderedDict[str, Record] = OrderedDict()
_PARSED_MAX = 8192  # bounded; still covers every record in flight in a 50-peer simulator


def parse(raw: bytes) -> Record:
    """Decode and verify one record from untrusted bytes. Raises ``RecordError``.

    Verified records are remembered by the hash of their bytes (a bounded LRU), so
    the same bytes arriving again (gossip repeats; many peers in one simulator
    process) are not verified twice. Identical bytes are the identical record."""
    rid = hashlib.sha256(raw).hexdigest()
    hit = _PARSED.get(rid)
    if hit is not None and hit.raw == raw:
        _PARSED.move_to_end(rid)
        return hit
    rec = _parse(raw, rid)
    _PARSED[rid] = rec
    if len(_PARSED) > _PARSED_MAX:
        _PARSED.popitem(last=False)
    return rec


def _parse(raw: bytes, rid: str) -> Record:
    obj = _codec.decode(raw, max_size=MAX_RECORD_BYTES)
    if type(obj) is not dict or set(obj) != {"v", "kind", "pool", "author", "body", "sig"}:
        raise RecordError("not a record object")
    if type(obj["v"]) is not int or obj["v"] != VERSION:
        raise RecordError(f"unsupported record version {obj['v']!r}")
    kind, pool, author, body, sig = obj["kind"], obj["pool"], obj["author"], obj["body"], obj["sig"]
    if type(kind) is not str or not _re(_HEX32)(pool) or not _HEX(author):
        raise RecordError("record header is malformed")
    if type(sig) is not str or not re.fullmatch(r"[0-9a-f]{128}", sig):
        raise RecordError("record signature is malformed")
    _check_body(kind, body)
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(author)).verify(
            bytes.fromhex(sig), _signed_part(kind, pool, author, body)
        )
    except (InvalidSignature, ValueError):
        raise RecordError(f"{kind} record signature does not verify") from None
    return Record(kind, pool, author, body, sig, raw, rid)
