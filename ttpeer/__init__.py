"""ttpeer: pool your own machines into one training run.

``ttpeer.load(path)`` loads what ``ttpeer export`` wrote (see ``ttpeer._api``).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "load"]


def __getattr__(name: str) -> Any:
    # Lazy: ``import ttpeer`` (every command line call) must not import torch.
    if name == "load":
        from ttpeer._api import load

        return load
    raise AttributeError(f"module 'ttpeer' has no attribute {name!r}")
