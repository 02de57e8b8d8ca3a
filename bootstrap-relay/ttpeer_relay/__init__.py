"""ttpeer-relay: the HTTPS rendezvous relay for ttpeer pools.

It installs and runs alone: no torch, and nothing from ``ttpeer`` except the pure
protocol package it carries as ``_proto``. Run it with ``ttpeer-relay`` (see
``cli``), or embed it in a trio program with ``serve(RelayConfig(...))``.
"""

from .cli import RelayConfig, RelayRunning, main, serve

__all__ = ["RelayConfig", "RelayRunning", "main", "serve"]
