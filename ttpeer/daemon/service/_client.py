"""The client half of the control socket (``_control`` serves it): what ``ttpeer
status`` and the other client commands use. Blocking and free of trio, so that a
client command imports little and answers at once. The requests and their replies
are ``control``'s."""

from __future__ import annotations

import json
import socket as pysocket
from pathlib import Path
from typing import Any, TypeVar

from ttpeer.errors import DaemonNotRunning, MembershipEnded, TtpeerError

from ..control import CODEC, Message, MessageError

R = TypeVar("R")


def ask(path: Path, request: Message[R], timeout: float = 60.0) -> R:
    """Send ``request`` (one of ``control``'s) to the daemon whose socket is ``path`` and
    return its reply, of the type the request names. Raises as ``call`` does, and
    ``TtpeerError`` for a reply this client cannot read."""
    reply = call(path, CODEC.encode(request), timeout)
    try:
        return CODEC.reply(request, {k: v for k, v in reply.items() if k != "ok"})
    except MessageError as exc:
        raise TtpeerError(f"the ttpeer daemon on {path.parent} answered {request.op!r} with a reply this "
                          f"command does not read ({exc}): restart it with this install's 'ttpeer up'") from None


def call(path: Path, request: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    """``ask`` with the request and the reply as plain dicts (``{"op": "status"}``), for
    scripts and tests. Raises ``DaemonNotRunning`` (no daemon, or it went away
    mid-request), ``MembershipEnded``, and ``TtpeerError`` when the daemon does not
    answer within ``timeout`` seconds or refuses the request."""
    s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        s.close()
        from .._home import ended_reason

        ended = ended_reason(path.parent)
        if ended is not None:  # 'ttpeer up' cannot help: say why instead
            raise MembershipEnded(f"no ttpeer daemon is running on {path.parent}: {ended}") from None
        raise DaemonNotRunning(
            f"no ttpeer daemon is running on {path.parent} (start it with 'ttpeer up')"
        ) from None
    try:
        with s:
            s.sendall(json.dumps(request).encode())
            s.shutdown(pysocket.SHUT_WR)
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
    except TimeoutError:
        raise TtpeerError(f"the ttpeer daemon on {path.parent} did not answer within {timeout:g} s: it may be "
                          "stopped (a suspended job, SIGSTOP) or overloaded; try again, or read its log") from None
    except (ConnectionResetError, BrokenPipeError):
        raise DaemonNotRunning(f"the ttpeer daemon on {path.parent} went away during the request "
                               "(start it again with 'ttpeer up')") from None
    if not chunks:  # it closed the connection: stopping, or it died in the middle
        raise DaemonNotRunning(f"the ttpeer daemon on {path.parent} closed the connection without answering "
                               "(it may be stopping; check 'ttpeer status' again, or start it with 'ttpeer up')")
    try:
        reply = json.loads(b"".join(chunks))
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        raise TtpeerError(f"the ttpeer daemon on {path.parent} answered with something that is not a reply")
    if not reply.get("ok"):
        raise TtpeerError(reply.get("error", "the daemon gave no answer"))
    return reply
