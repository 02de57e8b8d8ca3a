"""Give freed heap memory back to the operating system after a large operation.

glibc's malloc keeps what a process freed in its heaps (one per thread that allocated)
for reuse: after a round's close or a checkpoint, hundreds of MB the process no longer
uses stayed resident. ``malloc_trim(0)`` returns the free pages of every heap. A no-op
where the C library has no ``malloc_trim`` (musl, macOS).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

_trim: Callable[[int], int] | None = None
try:  # the C library already loaded in this process (find_library would run ldconfig)
    _trim = ctypes.CDLL(None).malloc_trim
except (OSError, AttributeError):
    _trim = None


def trim() -> None:
    if _trim is not None:
        _trim(0)
