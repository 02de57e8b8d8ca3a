"""The local control socket: how ``ttpeer status``, ``submit`` and ``wait`` talk to
the running daemon.

A Unix socket at ``HOME/control.sock``, mode 0600 in a 0700 home, so only its
owner can use it; the server also asks the kernel who connected (``SO_PEERCRED``)
and answers only its own user and root, should the modes ever be loosened.
One JSON request per connection, one JSON reply:
``{"op": "status"}``, ``{"op": "submit", "spec": {...}, "task_file": hex|null}``,
``{"op": "revoke", "peer": name|id|prefix}`` (admin only),
``{"op": "cancel", "job": id|prefix}`` (the job's submitter or the admin),
``{"op": "data_add", "path", "name", "piece_size"|null, "format", "urls": [...]|null, "relay": bool}``,
``{"op": "data_ls"}``,
``{"op": "data_rm", "dataset": name|id, "withdraw": bool}``,
``{"op": "relay_add", "url", "fingerprint"}`` and ``{"op": "relay_rm", "url"}`` (admin only),
``{"op": "relay_ls"}``.
Replies are ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``.
"""

from __future__ import annotations

import json
import logging
import os
import socket as pysocket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ttpeer.errors import TtpeerError

from ._client import call as call  # the client half, importable without trio
from ._urlsource import shown

if TYPE_CHECKING:
    from ._node import Node

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

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            uid = _peer_uid(stream.socket)
            if uid is not None and uid not in (os.getuid(), 0):
                log.warning("refused a control connection from uid %d: only this daemon's user may use it", uid)
                return
            try:
                request = json.loads(await _read_all(stream))
                reply = await _dispatch(node, request, status, ready)
            except TtpeerError as exc:
                reply = {"ok": False, "error": str(exc)}
            except (ValueError, KeyError, TypeError) as exc:
                reply = {"ok": False, "error": f"bad control request: {exc}"}
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


async def _dispatch(node: Node, request: dict[str, Any], status: Callable[[], dict[str, Any]] | None,
                    ready: trio.Event | None) -> dict[str, Any]:
    op = request.get("op")
    if op == "status":
        return {"ok": True, "status": status() if status is not None else node.status()}
    if op == "submit":
        if ready is not None:
            await ready.wait()
        task_file = bytes.fromhex(request["task_file"]) if request.get("task_file") else None
        job = await node.submit(request["spec"], task_file)
        return {"ok": True, "job": job.id, "shards": job["shards"], "lease": job["lease"],
                "params": job.body.get("params"), "trainable": job.body.get("trainable")}
    if op == "cancel":
        job, rec, again = await node.cancel(str(request.get("job", "")))
        by = node.machine.records.members.get(rec.author)
        return {"ok": True, "job": job.id, "record": rec.id, "by": by.name if by else rec.author[:12],
                "again": again}
    if op == "data_add":
        if ready is not None:
            await ready.wait()
        fmt = request.get("format")
        urls = request.get("urls")
        if urls is not None and not (type(urls) is list and all(type(u) is str for u in urls)):
            raise ValueError("urls must be a list of addresses")
        size = request.get("piece_size")
        rec, new = await node.data_add(str(request["path"]), request.get("name"), int(size) if size else None,
                                       str(fmt) if fmt else None, urls=urls, relay=bool(request.get("relay", True)))
        pieces = sum(len(f["pieces"]) for f in rec["files"])
        samples = rec.body.get("samples")
        return {"ok": True, "name": rec["name"], "id": rec["id"], "record": rec.id, "new": new,
                "urls": [shown(u) for u in rec.body.get("urls", ())],
                "files": len(rec["files"]), "pieces": pieces, "bytes": sum(f["size"] for f in rec["files"]),
                "format": fmt if samples else None, "samples": sum(samples["counts"]) if samples else 0}
    if op == "data_ls":
        return {"ok": True, "datasets": node.data.listing()}
    if op == "data_rm":
        if ready is not None:
            await ready.wait()
        return {"ok": True, **await node.data_remove(str(request["dataset"]), bool(request.get("withdraw")))}
    if op == "revoke":
        node.require_admin()
        peer, name = node.resolve_peer(str(request.get("peer", "")))
        again = peer not in node.machine.records.members
        rec = await node.revoke(peer)
        return {"ok": True, "peer": peer, "name": name, "record": rec.id, "epoch": len(node.pool_keys) - 1,
                "again": again}
    if op in ("relay_add", "relay_rm"):
        if ready is not None:
            await ready.wait()
        url = str(request.get("url", ""))
        made, said = (node.relay_change(add=(url, str(request.get("fingerprint", "")))) if op == "relay_add"
                      else node.relay_change(remove=url))
        return {"ok": True, "record": made.id if made is not None else None, "said": said,
                "relays": node.relay_list()}
    if op == "relay_ls":
        return {"ok": True, "relays": node.relay_list()}
    raise ValueError(f"unknown op {op!r}")
