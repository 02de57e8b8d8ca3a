"""Processes on loopback for tests and benches: the demo's process group, with its
commands run in this process."""

from __future__ import annotations

from pathlib import Path

from ttpeer.cli import run as ttpeer
from ttpeer.demo import READY_TIMEOUT, Cluster, job_spec, status, stop_processes, temporary_cluster, wait_for
from ttpeer.demo import make_pool as _make_pool

__all__ = ["READY_TIMEOUT", "Cluster", "job_spec", "make_pool", "status", "stop_processes", "temporary_cluster",
           "ttpeer", "wait_for"]


def make_pool(cluster: Cluster, url: str, fp: str, names: list[str], extra: tuple[str, ...] = ()) -> list[Path]:
    """``ttpeer.demo.make_pool``, creating the pool with ``ttpeer pool create`` in this process."""
    return _make_pool(cluster, url, fp, names, extra, command=ttpeer)
