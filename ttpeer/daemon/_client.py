"""The client half of the control socket (``_control`` serves it): what ``ttpeer
status`` and the other client commands use. Blocking and free of trio, so that a
client command imports little and answers at once."""

from __future__ import annotations

import json
import socket as pysocket
from pathlib import Path
from typing import Any

from ttpeer.errors import DaemonNotRunning, MembershipEnded, TtpeerError


def call(path: Path, request: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    """Blocking client used by the command line. Raises ``DaemonNotRunning`` (no daemon, or it
    went away mid-request), ``MembershipEnded``, and ``TtpeerError`` when the daemon does not
    answer within ``timeout`` seconds or refuses the request."""
    s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        s.close()
        from ._home import ended_reason

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
    reply = json.loads(b"".join(chunks))
    if not reply.get("ok"):
        raise TtpeerError(reply.get("error", "the daemon gave no answer"))
    return reply
