"""The lab's routed peers (``Lab(routed=[...])``), which ``scripts/bench/wan`` runs its
synchronous baselines on: they reach each other directly at their own addresses, also
through a shaped link, while NATed peers stay unreachable. Root only, like the rest of
``tests/netns``.
"""

from __future__ import annotations

import sys

import pytest

from ttpeer_harness.netlab import Lab, lab_namespaces, unavailable

WHY_NOT = unavailable()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

# Accepts one connection and answers with the address it came from.
_SERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9100)); s.listen()
while True:
    c, addr = s.accept()
    with c:
        c.sendall(addr[0].encode().ljust(16))
"""
_CLIENT = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], 9100), timeout=3)
    print(c.recv(16).decode().strip())
except OSError as e:
    print(type(e).__name__)
"""


def _ask(lab: Lab, source: str, target: str) -> str:
    return lab.hosts[source].run([sys.executable, "-c", _CLIENT, target], timeout=30).stdout.strip()


def test_routed_peers_reach_each_other_directly_and_nat_peers_stay_closed():
    with Lab(nat=["n"], routed=["x", "y"]) as lab:
        x, y, n = lab.hosts["x"], lab.hosts["y"], lab.hosts["n"]
        for host in (y, n):
            lab.popen(host, [sys.executable, "-c", _SERVER], f"server-{host.name}")
            lab.wait_port(host.ns, "0.0.0.0", 9100, f"the server on {host.name}")
        assert x.public == x.addr and n.public != n.addr
        assert _ask(lab, "x", y.addr) == x.addr  # no NAT on the way: y sees x's own address
        assert _ask(lab, "y", n.addr) in {"OSError", "TimeoutError"}  # no route to a NATed LAN
        assert _ask(lab, "y", n.public) == "TimeoutError"  # and its router drops inbound NEW
        lab.shape("x", "20mbit", 0.05)  # shaped and delayed: x's router's forwarder makes the connection
        assert _ask(lab, "x", y.addr).startswith("10.200.0.")  # from the router's wan address, still direct
    assert not [ns for ns in lab_namespaces() if ns.startswith(lab.tag + "-")]
