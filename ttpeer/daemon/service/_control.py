"""The local control socket: how ``ttpeer status``, ``submit``, ``wait`` and the other
client commands talk to the running daemon.

A Unix socket at ``HOME/control.sock``, mode 0600 in a 0700 home, so only its
owner can use it; the server also asks the kernel who connected (``SO_PEERCRED``)
and answers only its own user and root, should the modes ever be loosened.
One request per connection, one reply: what they are is ``control``'s, read and
written by its codec, and each request has one handler here (``_HANDLERS``). A
request that does not decode is answered ``bad control request: ...``, an error of
ttpeer's tree with its message; neither ends the server.
"""

from __future__ import annotations

import json
import logging
import os
import socket as pysocket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ttpeer.errors import TtpeerError

from .. import control
from .._codec import Message
from ..data._urlsource import shown
from ._client import call as call  # the client half, importable without trio

if TYPE_CHECKING:
    from ttpeer.proto import Record

    from ..node._node import Node

log = logging.getLogger("ttpeer.control")
MAX_REQUEST = 16 * 2**20


def _peer_uid(sock: Any) -> int | None:
    try:
        creds = sock.getsockopt(pysocket.SOL_SOCKET, pysocket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    return int(struct.unpack("3i", creds)[1])


async def serve_control(
    node: Node, path: Path, *, status: Callable[[], dict[str, Any]] | None = None,
    ready: trio.Event | None = None, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the control socket until cancelled. ``status`` builds the status reply
    (default ``node.status``); ``submit`` waits for ``ready`` (the node is running)."""
    path.unlink(missing_ok=True)
    sock = trio.socket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    server = _Server(node, status or node.status, ready)

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            uid = _peer_uid(stream.socket)
            if uid is not None and uid not in (os.getuid(), 0):
                log.warning("refused a control connection from uid %d: only this daemon's user may use it", uid)
                return
            try:
                request = control.CODEC.decode(_object(await _read_all(stream)))
                reply = {"ok": True, **control.CODEC.to_json(await _HANDLERS[type(request)](server, request))}
            except TtpeerError as exc:
                reply = {"ok": False, "error": str(exc)}
            except (ValueError, KeyError, TypeError, RecursionError) as exc:  # nested past the parser's depth
                reply = {"ok": False, "error": f"bad control request: {exc}"}
            except Exception as exc:  # noqa: BLE001 - a local client's request never ends the daemon
                log.exception("the control request failed")
                reply = {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"}
            try:
                await stream.send_all(json.dumps(reply).encode())
            except trio.BrokenResourceError:
                pass

    task_status.started()
    try:
        await trio.serve_listeners(handle, [listener])
    finally:
        path.unlink(missing_ok=True)


async def _read_all(stream: trio.SocketStream) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_REQUEST:
            raise ValueError("request too large")
        chunks.append(chunk)


def _object(data: bytes) -> dict[str, Any]:
    request = json.loads(data)
    if not isinstance(request, dict):
        raise ValueError("a request is one JSON object")
    return request


class _Server:
    """What the requests are served from: the node, the status it gives, and ``ready``
    (the node is running), which the requests that change the pool wait for."""

    def __init__(self, node: Node, status: Callable[[], dict[str, Any]], ready: trio.Event | None) -> None:
        self.node = node
        self._status = status
        self._ready = ready

    async def _started(self) -> None:
        if self._ready is not None:
            await self._ready.wait()

    async def status(self, _req: control.Status) -> control.StatusReply:
        return control.StatusReply(self._status())

    async def submit(self, req: control.Submit) -> control.Submitted:
        await self._started()
        from ttpeer.proto import JobSpec  # the server's side only: the client imports no proto

        job = JobSpec.of(await self.node.submit(req.spec, req.task_file))
        return control.Submitted(job.id, job.shards, job.lease, job.params, job.trainable)

    async def cancel(self, req: control.Cancel) -> control.Cancelled:
        job, rec, again = await self.node.cancel(req.job)
        by = self.node.machine.records.members.get(rec.author)
        return control.Cancelled(job.id, rec.id, by.name if by else rec.author[:12], again)

    async def revoke(self, req: control.Revoke) -> control.Revoked:
        self.node.require_admin()
        peer, name = self.node.resolve_peer(req.peer)
        again = peer not in self.node.machine.records.members
        rec = await self.node.revoke(peer)
        return control.Revoked(peer, name, rec.id, len(self.node.pool_keys) - 1, again)

    async def data_add(self, req: control.DataAdd) -> control.DataAdded:
        await self._started()
        rec, new = await self.node.data_add(req.path, req.name, req.piece_size or None, req.format or None,
                                            urls=req.urls, relay=req.relay)
        samples = rec.body.get("samples")
        return control.DataAdded(rec["name"], rec["id"], rec.id, new, [shown(u) for u in rec.body.get("urls", ())],
                                 files=len(rec["files"]), pieces=sum(len(f["pieces"]) for f in rec["files"]),
                                 bytes=sum(f["size"] for f in rec["files"]), format=req.format if samples else None,
                                 samples=sum(samples["counts"]) if samples else 0)

    async def data_list(self, _req: control.DataList) -> control.DataListing:
        return control.DataListing(self.node.data.listing())

    async def data_remove(self, req: control.DataRemove) -> control.DataRemoved:
        await self._started()
        return control.DataRemoved(**await self.node.data_remove(req.dataset, req.withdraw))

    async def relay_add(self, req: control.RelayAdd) -> control.RelaysChanged:
        await self._started()
        return self._relays(*self.node.relay_change(add=(req.url, req.fingerprint)))

    async def relay_remove(self, req: control.RelayRemove) -> control.RelaysChanged:
        await self._started()
        return self._relays(*self.node.relay_change(remove=req.url))

    async def relay_list(self, _req: control.RelayList) -> control.RelayListing:
        return control.RelayListing(self.node.relay_list())

    def _relays(self, made: Record | None, said: str) -> control.RelaysChanged:
        return control.RelaysChanged(made.id if made is not None else None, said, self.node.relay_list())


_HANDLERS: dict[type[Message[Any]], Callable[[_Server, Any], Awaitable[Any]]] = {
    control.Status: _Server.status, control.Submit: _Server.submit, control.Cancel: _Server.cancel,
    control.Revoke: _Server.revoke, control.DataAdd: _Server.data_add, control.DataList: _Server.data_list,
    control.DataRemove: _Server.data_remove, control.RelayAdd: _Server.relay_add,
    control.RelayRemove: _Server.relay_remove, control.RelayList: _Server.relay_list,
}
