"""Test doubles that are real implementations of ttpeer's interfaces, and the simulator."""

from ._fake import FakeDisk, FakeExecutor
from ._hostile import HostileRelay, Hostility
from ._sim import SimPeer, Simulation, deterministic

__all__ = ["FakeDisk", "FakeExecutor", "HostileRelay", "Hostility", "SimPeer", "Simulation", "deterministic"]
