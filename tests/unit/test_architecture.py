"""The import rules of docs/ARCHITECTURE.md ("Imports"), checked on the source.

Every ``import`` counts, also one inside a function or under ``TYPE_CHECKING``: a lazy
import is still a dependency. The layers, lowest first; a module may import its own
layer and the ones below, never one above, and the packages of one layer (``SIBLINGS``)
not each other:

    ttpeer_wire                          pure: records, codec, proofs, the relay API (shared with the relay)
    ttpeer.proto | ttpeer._figures       pure: membership views, ledger, machines (no I/O, no clock) | numbers as text
    ttpeer.net | ttpeer.train | base     trio + httpx | torch | errors, logging, settings
    ttpeer.tasks                         task helpers built on train (Hugging Face)
    ttpeer.daemon                        one nursery driving proto with net, train, the disk
    ttpeer.testing                       fakes and the simulator (real daemons, fake network)
    ttpeer                               the application: cli and its commands, demo, load()
    ttpeer_harness                       tests' and benches' processes and network lab
    bench                                the benchmarks

A new package gets a line in ``LAYERS`` (and in ``SIBLINGS`` if it must not know its
neighbours), and into ``PURE`` if it must stay without I/O too.

Inside the daemon, rooms (``ROOMS``): each imports its own modules, the floor's (``FLOOR``,
the modules beside ``ttpeer/daemon/__init__.py``) and the rooms listed for it; the floor
imports no room. The rooms are one package's parts: their private modules are the
daemon's, shared among the rooms, and still private to any other package.

    service  ->  node, worker, data
    node     ->  data, sealed          (never worker: it drives whatever Executor it is handed)
    worker   ->  data                  (DataStore, which the torch executor reads)
    data     ->  sealed
    sealed   ->  (the floor only)
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"ttpeer": ROOT / "ttpeer", "ttpeer_relay": ROOT / "bootstrap-relay" / "ttpeer_relay",
           "ttpeer_wire": ROOT / "bootstrap-relay" / "ttpeer_wire",
           "ttpeer_harness": ROOT / "ttpeer_harness", "bench": ROOT / "bench"}
SHIPPED = ("ttpeer", "ttpeer_relay", "ttpeer_wire")  # what the wheel holds (pyproject's packages)
BASE = ("ttpeer.errors", "ttpeer._logging", "ttpeer.config", "ttpeer._trim", "ttpeer._chunked")
LAYERS: list[tuple[str, ...]] = [
    ("ttpeer_wire",),
    ("ttpeer.proto", "ttpeer._figures"),
    ("ttpeer.net", "ttpeer.train", *BASE),
    ("ttpeer.tasks",),
    ("ttpeer.daemon",),
    ("ttpeer.testing",),
    ("ttpeer",),
    ("ttpeer_harness",),
    ("bench",),
]
SIBLINGS: list[tuple[str, ...]] = [("ttpeer.net", "ttpeer.train", BASE[0])]
SIBLING_GROUPS = {BASE[0]: BASE}  # one sibling that stands for several modules
# What the pure protocol and the wire contract may not import: I/O, the clock, the event
# loop, torch (the relay shares ttpeer_wire; the simulator drives proto).
_IMPURE = ("trio", "httpx", "httpcore", "torch", "numpy", "time", "datetime", "asyncio", "socket", "ssl", "threading",
           "subprocess")
PURE = {"ttpeer.proto": _IMPURE, "ttpeer_wire": _IMPURE}
# The relay installs and runs without torch, and without ttpeer (it imports ttpeer_wire).
RELAY_FORBIDS = ("torch", "numpy", "ttpeer", "ttpeer_harness", "bench")
# The daemon's rooms and the other rooms each may import (besides itself and the floor), as
# the code uses them: every pair listed is used, and any other is refused. A new module goes
# into a room; the floor grows only on purpose.
DAEMON = "ttpeer.daemon"
FLOOR = {"_codec", "_counters", "_executor", "_files", "_home", "_lifetime", "_offload", "_workfiles", "control"}
ROOMS: dict[str, set[str]] = {
    "sealed": set(),
    "data": {"sealed"},
    "worker": {"data"},
    "node": {"data", "sealed"},
    "service": {"data", "node", "worker"},
}
# Private modules of one package imported by another: each one a name to export from its
# package's door instead. Listed so that no new one comes in; remove a line with its fix.
KNOWN_PRIVATE = {
    ("ttpeer._api", "ttpeer.train._tasks"),
    ("ttpeer._commands", "ttpeer.daemon.service._units"),
    ("ttpeer._export", "ttpeer.tasks._hf_export"),
    ("ttpeer._report", "ttpeer.daemon._files"),
    ("ttpeer._report", "ttpeer.daemon.service._integrity"),
    ("ttpeer._report", "ttpeer.daemon.service._views"),
    ("ttpeer.cli", "ttpeer.daemon.service._systemd"),
    ("ttpeer.daemon.sealed._blobs", "ttpeer.net._entropy"),
    ("ttpeer.daemon.sealed._blobs", "ttpeer.net._seal"),
    ("ttpeer.daemon._home", "ttpeer.net._entropy"),
    ("ttpeer.daemon.sealed._keys", "ttpeer.net._entropy"),
    ("ttpeer.daemon.sealed._keys", "ttpeer.net._seal"),
    ("ttpeer.daemon.node._replay", "ttpeer.net._seal"),
    ("ttpeer.testing._hostile", "ttpeer.net._seal"),
    ("ttpeer.testing._sim", "ttpeer.net._entropy"),
}

# No module over MAX_LINES: a longer one is split by what it owns. The modules that were
# longer when the rule came in are listed with their length then: each may shrink (lower
# its number with it), none may grow; remove a line when its module is split.
MAX_LINES = 500
LONG_MODULES: dict[str, int] = {}  # a module over the limit, at its length: it may only shrink

def _modules() -> dict[str, Path]:
    found = {}
    for folder in SOURCES.values():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder.parent).with_suffix("")
            if "__pycache__" in rel.parts:
                continue
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> Iterator[str]:
    """Every module ``name`` imports (ours as modules, foreign ones by their top name)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in MODULES]
            yield from subs
            if len(subs) < len(node.names):
                yield module


GRAPH: dict[str, set[str]] = {name: set(_imports(name, path)) - {name} for name, path in MODULES.items()}


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _layer(module: str) -> tuple[int, str] | None:
    best = None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if _within(module, prefix) and (best is None or len(prefix) > len(best[1])):
                best = (i, prefix)
    return best


def _ours(target: str) -> bool:
    return target.split(".")[0] in SOURCES


def test_every_module_has_a_layer():
    assert [m for m in MODULES if not m.startswith("ttpeer_relay") and _layer(m) is None] == []


def test_no_layer_imports_one_above_it():
    upward = []
    for module, targets in GRAPH.items():
        here = _layer(module)
        for target in targets:
            there = _layer(target)
            # The root package itself runs on every import of a submodule, whatever imports it.
            if here and there and _ours(target) and target != "ttpeer" and there[0] > here[0]:
                upward.append(f"{module} -> {target}")
    assert sorted(upward) == []


def test_siblings_of_a_layer_do_not_import_each_other():
    crossing = []
    for group in SIBLINGS:
        members = {s: SIBLING_GROUPS.get(s, (s,)) for s in group}
        for module, targets in GRAPH.items():
            mine = [s for s, prefixes in members.items() if any(_within(module, p) for p in prefixes)]
            for target in targets:
                theirs = [s for s, prefixes in members.items() if any(_within(target, p) for p in prefixes)]
                if mine and theirs and mine != theirs:
                    crossing.append(f"{module} -> {target}")
    assert sorted(crossing) == []


def test_proto_is_pure():
    impure = [f"{module} -> {target}" for module, targets in GRAPH.items() for pkg, banned in PURE.items()
              if _within(module, pkg) for target in targets if target.split(".")[0] in banned
              or (_ours(target) and not any(_within(target, q) for q in PURE))]
    assert sorted(impure) == []


def test_the_relay_imports_no_torch_and_no_ttpeer():
    found = [f"{module} -> {target}" for module, targets in GRAPH.items() if _within(module, "ttpeer_relay")
             for target in targets if target.split(".")[0] in RELAY_FORBIDS]
    assert sorted(found) == []


def test_what_ships_imports_neither_the_harness_nor_the_benches():
    found = [f"{module} -> {target}" for module, targets in GRAPH.items() if module.split(".")[0] in SHIPPED
             for target in targets if target.split(".")[0] in ("ttpeer_harness", "bench", "tests")]
    assert sorted(found) == []


def _room(module: str) -> str | None:
    """The daemon's room of ``module`` (``node`` for ``ttpeer.daemon.node._node``), ``""`` for
    the floor and the daemon's door, None outside the daemon."""
    if not _within(module, DAEMON):
        return None
    first = module.removeprefix(DAEMON).removeprefix(".").split(".")[0]
    return first if first in ROOMS else ""


def _private_owner(target: str) -> str | None:
    """The package whose private module ``target`` is (``ttpeer.net`` for ``ttpeer.net._seal``;
    the daemon for a private module of one of its rooms)."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            owner = ".".join(parts[:i])
            return DAEMON if _room(owner) else owner
    return None


def test_no_package_imports_another_packages_private_module():
    found = set()
    for module, targets in GRAPH.items():
        if module.split(".")[0] not in SHIPPED:
            continue  # the harness and the benches reach inside, as tests do
        for target in targets:
            owner = _private_owner(target)
            if owner and _ours(target) and not _within(module, owner):
                found.add((module, target))
    assert sorted(found - KNOWN_PRIVATE) == []


def test_every_daemon_module_is_in_a_room_or_on_the_floor():
    floor = {m.removeprefix(DAEMON + ".") for m in MODULES if _room(m) == "" and m != DAEMON}
    assert floor == FLOOR
    assert {_room(m) for m in MODULES if _within(m, DAEMON)} == {"", *ROOMS}  # no room left empty
    public = [m for m in MODULES if _room(m) and m.count(".") > 2 and not m.rpartition(".")[2].startswith("_")]
    assert public == []  # a room's modules are the daemon's private ones; its surface is ttpeer.daemon's


def test_the_daemon_rooms_import_only_the_rooms_below():
    refused, used = [], set()
    for module, targets in GRAPH.items():
        here = _room(module)
        if here is None or module == DAEMON:
            continue  # the door names what it exports from every room, imported on first use
        for target in targets:
            there = _room(target)
            if there is None or there == here or there == "":
                continue
            used.add((here, there))
            if there not in ROOMS.get(here, set()):
                refused.append(f"{module} -> {target}")
    assert sorted(refused) == []
    assert used == {(room, other) for room, others in ROOMS.items() for other in others}  # no unused pair


def test_no_import_cycles():
    """Between modules, lazy imports included (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # the graph is small and shallow: recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH.get(v, ()):
            if w not in MODULES:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for v in MODULES:
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_wheel_holds_the_package_and_the_relay_only():
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert {p.split(".")[0] for p in packages} == set(SHIPPED)
    on_disk = {m for m, p in MODULES.items() if p.name == "__init__.py" and m.split(".")[0] in SHIPPED}
    assert on_disk <= set(packages)  # no shipped package forgotten either


def test_the_checks_see_the_imports():
    """The graph is not empty by mistake: a few edges that must be there."""
    assert any(_within(t, "ttpeer_wire") for t in GRAPH["ttpeer.net._relay_client"])
    assert any(_within(t, "ttpeer_wire") for t in GRAPH["ttpeer_relay.app"])
    assert "ttpeer.demo" in GRAPH["ttpeer.cli"]  # a lazy one, inside a function
    assert any(_within(t, "ttpeer.daemon") for t in GRAPH["ttpeer.testing._sim"])
    assert _private_owner("ttpeer.net._seal") == "ttpeer.net" and _private_owner("ttpeer.net") is None
    assert _private_owner("ttpeer.daemon.node._node") == DAEMON and _room("ttpeer.daemon._home") == ""
    assert "ttpeer.daemon.data._datastore" in GRAPH["ttpeer.daemon.worker._torch"]
    assert "ttpeer.daemon.control" in GRAPH["ttpeer.daemon.service._control"]  # from .. import control


def _group(module: str) -> str:
    layer = _layer(module)
    return layer[1] if layer else module.split(".")[0]


def test_layers_as_documented_have_no_unused_entries():
    used = defaultdict(int)
    for module in MODULES:
        layer = _layer(module)
        if layer:
            used[layer[1]] += 1
    assert [p for layer in LAYERS for p in layer if not used[p]] == []
    assert _group("ttpeer.daemon.node._node") == "ttpeer.daemon"


def test_no_module_is_over_500_lines_and_none_of_the_long_ones_grows():
    lengths = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    over = {name: n for name, n in lengths.items() if n > LONG_MODULES.get(name, MAX_LINES)}
    assert over == {}
    assert {name for name in LONG_MODULES if name not in MODULES} == set()  # a split module leaves the list


PROBES = ("getattr", "hasattr")


def test_no_getattr_probe_of_a_protocol_member():
    """Callers use what ``Executor``, ``Transport`` and ``PoolTransport`` declare; a method
    some implementations lack is declared (and given to all), not probed for."""
    from ttpeer.daemon import Executor
    from ttpeer.net import PoolTransport, Transport

    members = {name for proto in (Executor, Transport, PoolTransport)
               for name in [*vars(proto), *proto.__annotations__] if not name.startswith("_")}
    assert {"on_missing", "pieces", "bytes_sent", "spooled"} <= members
    probes = []
    for module, path in MODULES.items():
        if not _within(module, "ttpeer"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            probe = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES
            if (probe and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in members):
                probes.append(f"{module}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    assert probes == []


NODE = ROOT / "ttpeer" / "daemon" / "node" / "_node.py"


def _daemon_classes() -> set[str]:
    return {n.name for m, path in MODULES.items() if _within(m, DAEMON)
            for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, ast.ClassDef)}


def _parts_built(source: str, classes: set[str]) -> tuple[set[str], list[str]]:
    """The classes of ``classes`` that class ``Node`` in ``source`` builds, and those built
    with ``self`` as an argument, positional or keyword (``Part(self)``, ``Part(node=self)``)."""
    built, with_self = set(), []
    for cls in ast.walk(ast.parse(source)):
        if not (isinstance(cls, ast.ClassDef) and cls.name == "Node"):
            continue
        for call in ast.walk(cls):
            if not isinstance(call, ast.Call):
                continue
            func = call.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name not in classes:
                continue
            built.add(name)
            if any(isinstance(a, ast.Name) and a.id == "self" for a in [*call.args, *(k.value for k in call.keywords)]):
                with_self.append(f"{name}, line {call.lineno}")
    return built, with_self


def test_the_node_builds_each_part_with_what_it_uses_never_with_itself():
    """Issue 43: a part gets the narrow collaborators it uses through its constructor. One
    built as ``Part(self)`` holds the whole node and hides what it uses."""
    classes = _daemon_classes()
    built, with_self = _parts_built(NODE.read_text(), classes)
    assert with_self == []
    assert {"Effects", "Membership", "Follower", "Datasets", "Lifetime"} <= built  # the check sees the parts
    planted = ("class Node:\n    def __init__(self):\n        self.a = Effects(self)\n"
               "        self.b = data.Datasets(x=self)\n")
    assert _parts_built(planted, classes)[1] == ["Effects, line 3", "Datasets, line 4"]
