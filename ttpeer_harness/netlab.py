"""A network lab on one machine: a relay and peers, each in its own network namespace.

Theory of operation. ``Lab`` builds, as root, a small internet out of network
namespaces, all named ``ttpl-<pid>-<n>-...`` (the pid of the process that made
them) so parallel labs never touch each other and leftovers can be found:

    relay (10.200.0.1) ─┐
                        ├─ wan: a bridge, 10.200.0.0/24 ("the internet")
    gw1 (10.200.0.11) ──┤      a NAT router (MASQUERADE out; inbound NEW dropped)
      └─ h1 alice (10.200.11.2, private, default route via the router)
    gw3 (10.200.0.13) ──┘      a proxied peer's gateway: tinyproxy, no forwarding at all
      └─ h3 carol (10.200.13.2, no route out; HTTPS_PROXY=http://10.200.13.1:8888)

``routed=[...]`` peers sit behind a plain router instead (no NAT, inbound allowed, a
route to every other routed peer's LAN, and the relay's route back): they reach each other
and the relay at their own addresses, as the synchronous baselines of ``scripts/bench/wan``
(gloo, torchft) and the LAN shortcut's test need.

Links are veth pairs. ``shape(host, rate, delay)`` puts ``tbf`` on both ends of a
host's access link (the rate each way) and, for a delay, starts ``delayfwd.py``
in the host's gateway: an ``iptables REDIRECT`` sends the LAN's TCP connections
through it, and it holds each chunk ``delay`` seconds in each direction (so the
round trip grows by ``2 * delay``; the kernel here has no netem). ``cut(host)``
takes the gateway's end of the access link down (the peer's end loses carrier,
packets vanish, connections stall as if a cable were pulled); ``restore`` brings
it back.

Everything the lab starts is a process it tracks; ``close`` (also on an exception
inside ``with Lab(...)``) stops them, kills whatever is still inside its
namespaces, deletes the namespaces (which deletes their veths and bridge; nothing
is made in the root namespace) and removes its directory. ``down()`` (``scripts/netlab
down``) removes leftovers of labs whose process is gone.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ttpeer.errors import TtpeerError

from ._cluster import stop_processes

PREFIX = "ttpl-"
RELAY_ADDR = "10.200.0.1"
RELAY_PORT = 8443
SECOND_RELAY_PORT = 8444  # a second relay in the relay host (a pool of several relays)
PROXY_PORT = 8888
DELAY_PORT = 15001
READY_TIMEOUT = 60.0
_DELAYFWD = Path(__file__).with_name("delayfwd.py")
_counter = itertools.count()


class LabError(TtpeerError):
    """The lab could not be built or a command inside it failed."""


def _sh(*cmd: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise LabError(f"{cmd[0]} is not installed (apt-get install -y iproute2 iptables tinyproxy)") from None
    except subprocess.TimeoutExpired:
        raise LabError(f"{' '.join(cmd)} did not finish in {timeout:g} s") from None
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(cmd)} failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-800:]}")
    return done


def unavailable() -> str | None:
    """Why a lab cannot be built here (not root, no ``ip netns``, a tool missing); None if it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, iptables); CI runs as root"
    for tool in ("ip", "iptables", "tc", "tinyproxy"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install -y iproute2 iptables tinyproxy; .ci/run does)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _sh("ip", "netns", "add", probe)
    except LabError as exc:
        return f"'ip netns add' does not work here: {exc}"
    try:
        _sh("ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L")
    except LabError as exc:
        return f"iptables does not work in a namespace here: {exc}"
    finally:
        _sh("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One machine of the lab: a namespace, its address, how it reaches the world."""

    lab: Lab
    name: str
    ns: str
    addr: str  # its own address
    public: str  # the address others see its connections come from
    gateway: str | None = None  # the namespace of its router or proxy host
    link: tuple[str, str] = ("", "")  # (namespace, interface): the far end of its access link
    near: str = "eth0"  # its own end of the access link
    env: dict[str, str] = field(default_factory=dict)  # extra environment for its processes

    def cmd(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *args]

    def run(self, args: list[str], *, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``args`` inside this host; raises ``LabError`` when it fails and ``check``."""
        return _sh(*self.cmd(args), timeout=timeout, check=check)

    def popen(self, args: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``args`` inside this host in its own process group, output to ``LAB/name.log``;
        the lab stops it on close."""
        return self.lab.popen(self, args, name, env)


class Lab:
    """``with Lab(nat=["alice", "bob"], proxied=["carol"]) as lab:`` builds the topology
    above; ``lab.hosts[NAME]`` (and ``lab.relay``) are its ``Host``s."""

    def __init__(self, nat: list[str] | tuple[str, ...] = (), proxied: list[str] | tuple[str, ...] = (),
                 root: Path | None = None, keep: bool = False, routed: list[str] | tuple[str, ...] = ()) -> None:
        self.tag = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.dir = root or Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self.keep = keep
        self.nat = list(nat)
        self.proxied = list(proxied)
        self.routed = list(routed)
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.hosts: dict[str, Host] = {}
        self._delays: dict[str, subprocess.Popen[bytes]] = {}  # gateway ns -> its forwarder
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "TTPEER_CONFIG": str(self.dir / "ttpeer.toml")}
        for var in ("TTPEER_HOME", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
            self.env.pop(var, None)

    # -- building ---------------------------------------------------------------------

    def __enter__(self) -> Lab:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def relay(self) -> Host:
        return self.hosts["relay"]

    def _ns(self, suffix: str) -> str:
        ns = f"{self.tag}-{suffix}"
        _sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _veth(self, ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
        _sh("ip", "-n", ns_a, "link", "add", if_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
        _sh("ip", "-n", ns_a, "link", "set", if_a, "up")
        _sh("ip", "-n", ns_b, "link", "set", if_b, "up")

    def _ipt(self, ns: str, *rule: str) -> None:
        _sh("ip", "netns", "exec", ns, "iptables", "-w", *rule)

    def build(self) -> None:
        names = [*self.nat, *self.proxied, *self.routed]
        if len(set(names)) != len(names) or "relay" in names or len(names) > 200:
            raise LabError(f"peer names must be distinct, not 'relay', at most 200: {names}")
        wan = self._ns("wan")
        _sh("ip", "-n", wan, "link", "add", "br0", "type", "bridge", "forward_delay", "0", "stp_state", "0")
        _sh("ip", "-n", wan, "link", "set", "br0", "up")
        relay_ns = self._ns("relay")
        self._veth(wan, "p0", relay_ns, "eth0")
        _sh("ip", "-n", wan, "link", "set", "p0", "master", "br0")
        _sh("ip", "-n", relay_ns, "addr", "add", f"{RELAY_ADDR}/24", "dev", "eth0")
        self.hosts["relay"] = Host(self, "relay", relay_ns, RELAY_ADDR, RELAY_ADDR, None, (wan, "p0"))
        for i, name in enumerate(names, start=1):
            self._add_peer(wan, i, name, proxied=name in self.proxied)
        self._route_between([self.hosts[name] for name in self.routed])

    def _add_peer(self, wan: str, i: int, name: str, *, proxied: bool) -> None:
        gw, ns = self._ns(f"gw{i}"), self._ns(f"h{i}")
        public, lan_gw, addr = f"10.200.0.{10 + i}", f"10.200.{10 + i}.1", f"10.200.{10 + i}.2"
        self._veth(wan, f"p{i}", gw, "wan")
        _sh("ip", "-n", wan, "link", "set", f"p{i}", "master", "br0")
        _sh("ip", "-n", gw, "addr", "add", f"{public}/24", "dev", "wan")
        self._veth(gw, "lan", ns, "eth0")
        _sh("ip", "-n", gw, "addr", "add", f"{lan_gw}/24", "dev", "lan")
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        # Nothing from the internet starts a connection with the gateway or beyond it.
        self._ipt(gw, "-P", "FORWARD", "DROP")
        self._ipt(gw, "-A", "INPUT", "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        self._ipt(gw, "-A", "INPUT", "-i", "wan", "-j", "DROP")
        env: dict[str, str] = {}
        if proxied:  # no forwarding, no route out: the proxy is the only way
            conf = self.dir / f"tinyproxy-{name}.conf"
            conf.write_text(f"Port {PROXY_PORT}\nListen {lan_gw}\nTimeout 600\nMaxClients 100\n"
                            f"Allow 10.200.0.0/16\nConnectPort {RELAY_PORT}\nConnectPort {SECOND_RELAY_PORT}\n"
                            "LogLevel Info\n")
            host = Host(self, name, ns, addr, public, gw, (gw, "lan"), env=env)
            self.hosts[name] = host
            self.popen(Host(self, f"proxy-{name}", gw, lan_gw, public), ["tinyproxy", "-d", "-c", str(conf)],
                       f"tinyproxy-{name}")
            env["HTTPS_PROXY"] = f"http://{lan_gw}:{PROXY_PORT}"
            self.wait_port(gw, lan_gw, PROXY_PORT, f"tinyproxy for {name}")
        else:
            _sh("ip", "-n", ns, "route", "add", "default", "via", lan_gw)
            _sh("ip", "netns", "exec", gw, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
            self._ipt(gw, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
            self._ipt(gw, "-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "ACCEPT")
            self._ipt(gw, "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack", "--ctstate",
                      "ESTABLISHED,RELATED", "-j", "ACCEPT")
            self.hosts[name] = Host(self, name, ns, addr, public, gw, (gw, "lan"), env=env)

    def _route_between(self, hosts: list[Host]) -> None:
        """Turn the NAT routers of ``hosts`` into plain routers that reach each other's LANs."""
        routers = {host.name: host.public for host in hosts}  # each gateway's address on the wan
        for host in hosts:
            assert host.gateway is not None
            self._ipt(host.gateway, "-t", "nat", "-F", "POSTROUTING")
            self._ipt(host.gateway, "-A", "FORWARD", "-i", "wan", "-o", "lan", "-j", "ACCEPT")
            for other in hosts:
                if other is not host:
                    lan = other.addr.rsplit(".", 1)[0] + ".0/24"
                    _sh("ip", "-n", host.gateway, "route", "add", lan, "via", routers[other.name])
            # The relay answers a routed peer at its own address, as the internet reaches a
            # public one (NAT gateways learn no such route: their LANs stay apart).
            _sh("ip", "-n", self.hosts["relay"].ns, "route", "add", host.addr.rsplit(".", 1)[0] + ".0/24",
                "via", routers[host.name])
            host.public = host.addr

    def wait_port(self, ns: str, addr: str, port: int, what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = _sh("ip", "netns", "exec", ns, "ss", "-Hltn", f"src {addr}:{port}", check=False).stdout
            if out.strip():
                return
            time.sleep(0.05)
        raise LabError(f"{what} did not listen on {addr}:{port} within {timeout:g} s")

    # -- processes ---------------------------------------------------------------------

    def popen(self, host: Host, args: list[str], name: str, env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        with open(self.dir / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(host.cmd(args), stdout=out, stderr=subprocess.STDOUT,
                                    env={**self.env, **host.env, **(env or {})}, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self, host: Host | str) -> None:
        """Stop the processes the lab started inside ``host`` (a daemon and its workers),
        leaving the rest of the lab running."""
        host = self.hosts[host] if isinstance(host, str) else host
        stop_processes([p for p in self.procs if p.args[:4] == host.cmd([])])  # type: ignore[index]

    def log(self, name: str) -> str:
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- shaping, cutting --------------------------------------------------------------

    def shape(self, host: Host | str, rate: str | None = None, delay: float = 0.0) -> None:
        """Limit ``host``'s access link to ``rate`` each way (tc syntax: "20mbit"; None: no
        limit) and add ``delay`` seconds to each direction of its TCP connections (one way;
        peers only: the delay lives in their gateway)."""
        host = self.hosts[host] if isinstance(host, str) else host
        far_ns, far_if = host.link
        for ns, dev in ((host.ns, host.near), (far_ns, far_if)):
            if rate is None:
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            else:
                bits = _rate_bits(rate)
                burst = max(32 * 1024, bits // 8 // 100)  # at least one 10 ms tick of bytes
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                    "rate", rate, "burst", str(burst), "latency", "100ms")
        if delay or host.gateway in self._delays:
            if host.gateway is None:
                raise LabError("a delay goes in a peer's gateway; the relay has none (delay its peers)")
            self._set_delay(host, delay)

    def _set_delay(self, host: Host, delay: float) -> None:
        gw = host.gateway
        assert gw is not None
        file = self.dir / f"delay-{host.name}"
        file.write_text(f"{delay}\n")
        proc = self._delays.get(gw)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGHUP)
            return
        lan_gw = host.addr.rsplit(".", 1)[0] + ".1"
        self._delays[gw] = self.popen(Host(self, f"delay-{host.name}", gw, lan_gw, lan_gw),
                                      [sys.executable, str(_DELAYFWD), lan_gw, str(DELAY_PORT), str(file)],
                                      f"delay-{host.name}")
        self.wait_port(gw, lan_gw, DELAY_PORT, f"the delay forwarder for {host.name}")
        self._ipt(gw, "-t", "nat", "-A", "PREROUTING", "-i", "lan", "-p", "tcp", "-j", "REDIRECT",
                  "--to-ports", str(DELAY_PORT))
        self._ipt(gw, "-I", "INPUT", "-i", "lan", "-p", "tcp", "--dport", str(DELAY_PORT), "-j", "ACCEPT")

    def cut(self, host: Host | str) -> None:
        """Pull ``host``'s cable: its link goes down at the far end; packets vanish."""
        host = self.hosts[host] if isinstance(host, str) else host
        _sh("ip", "-n", host.link[0], "link", "set", host.link[1], "down")

    def restore(self, host: Host | str) -> None:
        host = self.hosts[host] if isinstance(host, str) else host
        _sh("ip", "-n", host.link[0], "link", "set", host.link[1], "up")

    # -- tearing down --------------------------------------------------------------------

    def close(self) -> None:
        stop_processes(self.procs)
        for ns in reversed(self.namespaces):
            _remove_namespace(ns)
        self.namespaces.clear()
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def _rate_bits(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit) and rate[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(rate[: -len(unit)]) * scale)
    raise LabError(f"rate must look like 20mbit, 512kbit or 1gbit, not {rate!r}")


def _remove_namespace(ns: str) -> None:
    """Kill every process still inside ``ns`` (by pid), then delete it."""
    for _ in range(3):
        pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.1)
    _sh("ip", "netns", "del", ns, check=False)


def lab_namespaces() -> list[str]:
    out = _sh("ip", "-j", "netns", "list", check=False).stdout.strip()
    try:
        entries: list[dict[str, Any]] = json.loads(out) if out else []
    except ValueError:
        entries = [{"name": line.split()[0]} for line in out.splitlines() if line.strip()]
    return [e["name"] for e in entries if str(e.get("name", "")).startswith(PREFIX)]


def down(all_labs: bool = False, prefix: str = PREFIX) -> list[str]:
    """Remove the namespaces (and the processes in them) of labs whose creating process
    has exited; with ``all_labs``, of every lab; only those named ``prefix...``. Returns
    what was removed."""
    removed = []
    for ns in (n for n in lab_namespaces() if n.startswith(prefix)):
        owner = ns[len(PREFIX):].split("-", 1)[0]
        if not all_labs and owner.isdigit() and Path(f"/proc/{owner}").exists():
            continue
        _remove_namespace(ns)
        removed.append(ns)
    return removed


# -- ttpeer inside the lab -----------------------------------------------------------------


def ttpeer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ttpeer", *args]


def start_relay(lab: Lab, *extra: str) -> tuple[str, str]:
    """Run ``ttpeer relay`` in the relay host; returns its URL and certificate fingerprint."""
    _proc, url, fp = start_relay_process(lab, *extra)
    return url, fp


def start_relay_process(lab: Lab, *extra: str, port: int = RELAY_PORT,
                        name: str = "relay") -> tuple[subprocess.Popen[bytes], str, str]:
    """``start_relay`` on ``port`` of the relay host (another port: another relay, its data
    and log named ``name``); returns its process too, for a test that kills it."""
    proc = lab.relay.popen(ttpeer_cmd("relay", "--listen", f"{RELAY_ADDR}:{port}", "--data",
                                      str(lab.dir / f"{name}-data"), *extra), name)
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        for line in lab.log(name).splitlines():
            if line.startswith("relay ready "):
                _, _, url, fp = line.split()
                return proc, url, fp
        if proc.poll() is not None:
            raise LabError(f"the relay exited early:\n{lab.log(name)[-2000:]}")
        time.sleep(0.05)
    raise LabError("the relay did not report ready in time")


def home_of(lab: Lab, name: str) -> Path:
    return lab.dir / "homes" / name


def start_pool(lab: Lab, url: str, fingerprint: str, admin: str, members: list[str],
               extra: tuple[str, ...] = ()) -> dict[str, Path]:
    """``ttpeer pool create`` + ``ttpeer up`` on ``admin``, ``ttpeer join TOKEN`` on each of
    ``members``, every command inside its host (a proxied host through its proxy). Returns
    the homes by name once every peer has the pool key and sees all the others."""
    from ._cluster import status, wait_for

    homes = {name: home_of(lab, name) for name in [admin, *members]}
    host = lab.hosts[admin]
    created = _sh(*host.cmd(ttpeer_cmd("pool", "create", "--relay", url, "--fingerprint", fingerprint,
                                       "--name", admin, "--uses", str(max(1, len(members))),
                                       "--home", str(homes[admin]))), timeout=READY_TIMEOUT)
    token = created.stdout.strip().splitlines()[-1]
    host.popen(ttpeer_cmd("up", "--home", str(homes[admin]), *extra), admin)
    for name in members:
        lab.hosts[name].popen(ttpeer_cmd("join", token, "--name", name, "--home", str(homes[name]), *extra), name)

    def all_in() -> bool:
        for home in homes.values():
            if not (home / "control.sock").exists():
                return False
            st = status(home)
            if not st["node"]["has_pool_key"] or len(st["peers"]) < len(homes):
                return False
        return True

    try:
        wait_for(all_in, 2 * READY_TIMEOUT, f"{len(homes)} peers to enroll")
    except TtpeerError as exc:
        logs = "\n".join(f"--- {n}:\n{lab.log(n)[-1500:]}" for n in homes)
        raise LabError(f"{exc}\n{logs}") from None
    return homes


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="scripts/netlab", description="network lab namespaces (ttpl-*)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("down", help="remove the namespaces and processes of labs whose process is gone")
    d.add_argument("--all", action="store_true", help="every lab's, also of running ones")
    sub.add_parser("list", help="the lab namespaces that exist")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("error: the network lab needs root", file=sys.stderr)
        return 1
    if args.cmd == "list":
        print("\n".join(lab_namespaces()))
        return 0
    removed = down(all_labs=args.all)
    print(f"removed {len(removed)} namespace(s)" + "".join(f"\n  {ns}" for ns in removed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
