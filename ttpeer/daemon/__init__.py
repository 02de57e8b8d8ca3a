"""The daemon: drives the protocol with real I/O in one trio nursery.

The names are imported on first use: client commands (``ttpeer status``) need only
``ask`` (with the requests of ``ttpeer.daemon.control``) and ``Home``, and importing
``run_daemon`` would pull in torch (seconds).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._client import ask, call
    from ._datastore import DataStore
    from ._executor import DeltaRef, Deltas, Executor, delta_bytes
    from ._home import Home, PoolConfig, new_invite
    from ._node import Node
    from ._run import run_daemon

_WHERE = {"ask": "_client", "call": "_client", "DataStore": "_datastore", "Executor": "_executor",
          "DeltaRef": "_executor", "Deltas": "_executor", "delta_bytes": "_executor", "Home": "_home",
          "PoolConfig": "_home", "new_invite": "_home",
          "Node": "_node", "run_daemon": "_run"}

__all__ = ["DataStore", "DeltaRef", "Deltas", "Executor", "Home", "Node", "PoolConfig", "ask", "call",
           "delta_bytes", "new_invite", "run_daemon"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'ttpeer.daemon' has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value  # once: later lookups skip this function
    return value
