"""The daemon: drives the protocol with real I/O in one trio nursery.

It is kept in rooms, one subsystem each; a room imports the floor and the rooms
below it, never one above (``tests/unit/test_architecture.py``, ``ROOMS``):

    sealed/    the pool's key epochs and what is sealed with them: blobs on the relays
    data/      datasets that reach the peers: the cache, fetching, holding, the LAN shortcut
    worker/    worker processes, and the torch executor they run (reads DataStore)
    node/      Node and what it drives: effects, the relay link, membership, the record log
    service/   running as a service and talking to the user: start-up, control socket,
               status extras, metrics, TensorBoard, systemd and its units

The floor, here beside this file, is what two or more rooms share and owns no
subsystem: the home on disk (``_home``, ``_files``), the executor interface
(``_executor``), the one codec of the local channels (``_codec``) and the control
socket's requests (``control``, public), work files, off-loop work and the counters.

The names are imported on first use: client commands (``ttpeer status``) need only
``ask`` (with the requests of ``ttpeer.daemon.control``) and ``Home``, and importing
``run_daemon`` would pull in torch (seconds).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._executor import DeltaRef, Deltas, Executor, delta_bytes
    from ._home import Home, PoolConfig, new_invite
    from .data._datastore import DataStore
    from .node._node import Node
    from .service._client import ask, call
    from .service._run import run_daemon

_WHERE = {"ask": "service._client", "call": "service._client", "DataStore": "data._datastore",
          "Executor": "_executor", "DeltaRef": "_executor", "Deltas": "_executor", "delta_bytes": "_executor",
          "Home": "_home", "PoolConfig": "_home", "new_invite": "_home",
          "Node": "node._node", "run_daemon": "service._run"}

__all__ = ["DataStore", "DeltaRef", "Deltas", "Executor", "Home", "Node", "PoolConfig", "ask", "call",
           "delta_bytes", "new_invite", "run_daemon"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'ttpeer.daemon' has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value  # once: later lookups skip this function
    return value
