"""The secrets of a run of processes, spelled as a leak would spell them."""

from __future__ import annotations

import base64
from pathlib import Path

KEY_FILES = ("node.key", "seal.key", "pool.key", "root.key", "pool.keys")


def secrets_of(homes: list[Path], tokens: list[str]) -> dict[str, str]:
    """Every secret of the run, by what it is, in the spellings a leak would take: each
    32-byte key of every home in hex, base64 and url-safe base64, each token whole and a
    stretch of its body. Search logs and outputs for the values."""
    found: dict[str, str] = {}
    for i, token in enumerate(tokens):
        found[f"token{i}"] = token
        found[f"token{i} body"] = token[5:45]
    for home in homes:
        for name in KEY_FILES:
            path = home / name
            if not path.exists():
                continue
            data = path.read_bytes()
            for j in range(0, len(data), 32):
                key = data[j : j + 32]
                found[f"{home.name}/{name}[{j // 32}] hex"] = key.hex()
                found[f"{home.name}/{name}[{j // 32}] b64"] = base64.b64encode(key).decode()[:40]
                found[f"{home.name}/{name}[{j // 32}] b64url"] = base64.urlsafe_b64encode(key).decode()[:40]
    return found
