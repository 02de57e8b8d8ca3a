"""What tests and benches drive ttpeer with, beside the package and not in its wheel.

- ``Cluster``, ``make_pool``, ``status``, ``wait_for``...: a relay and peers as real
  ``ttpeer`` processes on loopback (the demo's process group, ``ttpeer.demo``), and
  ``ttpeer(*args)``, one command run in this process (``ttpeer.cli.run``);
- ``secrets_of``: every key of a run's homes and its tokens, as a leak would spell them;
- ``ttpeer_harness.netlab``: the network lab (root), relay and peers in network
  namespaces behind NAT and a CONNECT proxy, links shaped with ``tc`` and
  ``delayfwd.py`` (a delaying TCP forwarder, run as a script).

Importable from the repository root (pytest, ``python -m bench.NAME``), never by
``ttpeer`` itself: tests/unit/test_architecture.py holds that.
"""

from ._cluster import (
    READY_TIMEOUT,
    Cluster,
    job_spec,
    make_pool,
    status,
    stop_processes,
    temporary_cluster,
    ttpeer,
    wait_for,
)
from ._secrets import secrets_of

__all__ = [
    "READY_TIMEOUT", "Cluster", "job_spec", "make_pool", "status", "stop_processes", "temporary_cluster", "ttpeer",
    "secrets_of", "wait_for",
]
