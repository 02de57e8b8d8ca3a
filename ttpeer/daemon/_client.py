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
    """Blocking client used by the command line. Raises ``DaemonNotRunning``."""
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
    with s:
        s.sendall(json.dumps(request).encode())
        s.shutdown(pysocket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    reply = json.loads(b"".join(chunks) or b"{}")
    if not reply.get("ok"):
        raise TtpeerError(reply.get("error", "the daemon gave no answer"))
    return reply
