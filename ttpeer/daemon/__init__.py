"""The daemon: drives the protocol with real I/O in one trio nursery."""

from ._control import call
from ._executor import DeltaRef, Deltas, Executor, delta_bytes
from ._home import Home, PoolConfig, default_home, new_invite
from ._node import Node
from ._run import run_daemon

__all__ = ["DeltaRef", "Deltas", "Executor", "Home", "Node", "PoolConfig", "call", "default_home", "delta_bytes",
           "new_invite", "run_daemon"]
