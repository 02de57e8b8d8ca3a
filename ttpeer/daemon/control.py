"""What a client may ask the running daemon over its control socket, and what it gets back.

One request per connection, as one JSON object (``{"op": ..., **fields}``, written by
``CODEC``), and one reply: ``{"ok": true, **the reply's fields}``, or ``{"ok": false,
"error": message}``. ``ask`` (``ttpeer.daemon``) sends a request and reads its reply as
its type; ``call`` does the same with plain dicts, for scripts. The daemon serves them
in ``_control``. A client and a daemon are one install: an op or a field that the other
side does not know is refused as a bad request, and no other version is read.

    Status                                    StatusReply (the snapshot of ``ttpeer status``)
    Submit(spec, task_file)                   Submitted
    Cancel(job)   the submitter or the admin  Cancelled
    Revoke(peer)  the admin                   Revoked
    DataAdd(path, name, ...)                  DataAdded
    DataList                                  DataListing
    DataRemove(dataset, withdraw)             DataRemoved
    RelayAdd(url, fingerprint)  the admin     RelaysChanged
    RelayRemove(url)            the admin     RelaysChanged
    RelayList                                 RelayListing
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._codec import Codec, Message, MessageError

__all__ = ["CODEC", "Cancel", "Cancelled", "DataAdd", "DataAdded", "DataList", "DataListing", "DataRemove",
           "DataRemoved", "Message", "MessageError", "RelayAdd", "RelayList", "RelayListing", "RelayRemove",
           "RelaysChanged", "Revoke", "Revoked", "Status", "StatusReply", "Submit", "Submitted"]


# -- replies ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StatusReply:
    status: dict[str, Any]


@dataclass(frozen=True)
class Submitted:
    job: str
    shards: int
    lease: float
    params: int | None
    trainable: int | None


@dataclass(frozen=True)
class Cancelled:
    job: str
    record: str
    by: str  # who signed the cancel that counts: a member's name, else its id's start
    again: bool  # the job was cancelled already


@dataclass(frozen=True)
class Revoked:
    peer: str
    name: str
    record: str
    epoch: int  # the pool key's, after the revocation
    again: bool  # revoked already: the relay was told again


@dataclass(frozen=True)
class DataAdded:
    name: str
    id: str
    record: str
    new: bool
    urls: list[str]
    files: int
    pieces: int
    bytes: int
    format: str | None  # the samples' format, when they were indexed
    samples: int


@dataclass(frozen=True)
class DataListing:
    datasets: list[dict[str, Any]]


@dataclass(frozen=True)
class DataRemoved:
    id: str
    removed: bool
    withdrawn: list[str]  # the withdraw records signed


@dataclass(frozen=True)
class RelaysChanged:
    record: str | None  # the relays record signed, if any
    said: str
    relays: list[dict[str, Any]]


@dataclass(frozen=True)
class RelayListing:
    relays: list[dict[str, Any]]


# -- requests ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Status(Message[StatusReply]):
    op = "status"


@dataclass(frozen=True)
class Submit(Message[Submitted]):
    op = "submit"
    spec: dict[str, Any]
    task_file: bytes | None = None


@dataclass(frozen=True)
class Cancel(Message[Cancelled]):
    op = "cancel"
    job: str  # an id or a unique prefix


@dataclass(frozen=True)
class Revoke(Message[Revoked]):
    op = "revoke"
    peer: str  # a name, an id or a unique prefix


@dataclass(frozen=True)
class DataAdd(Message[DataAdded]):
    op = "data_add"
    path: str
    name: str | None = None
    piece_size: int | None = None
    format: str | None = None
    urls: list[str] | None = None
    relay: bool = True


@dataclass(frozen=True)
class DataList(Message[DataListing]):
    op = "data_ls"


@dataclass(frozen=True)
class DataRemove(Message[DataRemoved]):
    op = "data_rm"
    dataset: str  # a name or an id
    withdraw: bool = False


@dataclass(frozen=True)
class RelayAdd(Message[RelaysChanged]):
    op = "relay_add"
    url: str
    fingerprint: str


@dataclass(frozen=True)
class RelayRemove(Message[RelaysChanged]):
    op = "relay_rm"
    url: str


@dataclass(frozen=True)
class RelayList(Message[RelayListing]):
    op = "relay_ls"


CODEC = Codec((Status, Submit, Cancel, Revoke, DataAdd, DataList, DataRemove, RelayAdd, RelayRemove, RelayList))
