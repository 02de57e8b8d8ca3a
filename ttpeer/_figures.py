"""Numbers as a person reads them, for every message and table.

Pure, and in the lowest layer of ``ttpeer`` beside ``proto`` (tests/unit/test_architecture.py),
so that ``train`` and the client commands both print with it without importing the protocol."""

from __future__ import annotations


def size(n: float) -> str:
    """Bytes: ``512 B``, ``1.5 KiB``, ``3.2 GiB``, ``1.1 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def count(n: int) -> str:
    """A parameter count as people say it: ``7.6B``, ``42.0M``, ``8.2K``, ``512``."""
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)
