"""ttpeer-relay: the HTTPS rendezvous relay for ttpeer pools.

It installs and runs alone: no torch and no ``ttpeer``; what it shares with the peers
(records, membership proofs, the API's paths, limits and error codes) is ``ttpeer_wire``,
which ships with it. Run it with ``ttpeer-relay`` (see
``cli``), or embed it in a trio program with ``serve(RelayConfig(...))``.
"""

from .cli import RelayConfig, RelayRunning, main, serve

__all__ = ["RelayConfig", "RelayRunning", "main", "serve"]
