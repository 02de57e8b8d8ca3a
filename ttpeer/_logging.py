"""Logging for every ttpeer command: quiet by default, structured, and never a secret.

Lines go to stderr as text (``TIME LEVEL LOGGER: message``) or, with
``log_format = "json"``, one JSON object a line (``ts``, ``level``, ``logger``,
``msg`` and ``exc`` for a traceback) for journald or a log shipper. The default
level is warning, so a healthy daemon prints only its ready line.

Secrets: every formatted line, traceback included, passes through ``redact``,
which replaces join tokens (anything shaped ``ttp1.…``), the query of any https
address (a dataset's ``--url`` may carry a token there) and every key registered
with ``add_secret`` (the daemon registers its node, seal, pool and root keys in
hex and base64) by ``[redacted]``. Code does not log secrets in the first place;
this is the second wall.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import sys
import time

_TOKEN = re.compile(r"ttp1\.[A-Za-z0-9_\-.=~+/]+")
_URL_QUERY = re.compile(r"(https://[^\s?#\"']*)\?[^\s\"'#]+")
_secrets: set[str] = set()
REDACTED = "[redacted]"
NOISY = ("httpx", "httpcore", "hypercorn", "matplotlib", "PIL")


def add_secret(raw: bytes) -> None:
    """Never print ``raw`` in hex or base64, in any later log line."""
    if len(raw) < 8:
        return
    _secrets.update({raw.hex(), raw.hex().upper(), base64.b64encode(raw).decode(),
                     base64.urlsafe_b64encode(raw).decode().rstrip("=")})


def redact(text: str) -> str:
    text = _TOKEN.sub("ttp1." + REDACTED, text)
    text = _URL_QUERY.sub(r"\1?" + REDACTED, text)
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


class _Text(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class _Json(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage(),
        }
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return redact(json.dumps(obj, ensure_ascii=False))


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is now (test runners swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def setup(level: str = "warning", fmt: str = "text") -> None:
    """Configure the root logger once for this process (``level``: error, warning,
    info, debug; ``fmt``: text or json). Libraries stay at warning unless debugging."""
    numeric = getattr(logging, level.upper())
    handler = _Stderr(sys.stderr)
    handler.setFormatter(_Json() if fmt == "json" else _Text())
    handler.set_name("ttpeer")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "ttpeer"]:
        root.removeHandler(old)  # only our own: a test runner's capture handlers stay
    root.addHandler(handler)
    root.setLevel(numeric)
    for noisy in NOISY:
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))
