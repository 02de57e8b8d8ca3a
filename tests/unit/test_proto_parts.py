"""The parts of ``PeerMachine`` (issue 16): no part imports the facade, the parts'
imports form no circle, and none of proto imports I/O, a clock, trio, httpx or torch."""

from __future__ import annotations

import ast
from pathlib import Path

PROTO = Path(__file__).resolve().parents[2] / "ttpeer" / "proto"
PARTS = ["_antientropy", "_closer", "_follower", "_jobspec", "_leases", "_lifecycle", "_local", "_reports",
         "_rounds", "_views"]
FORBIDDEN = {"trio", "httpx", "torch", "time", "socket", "asyncio", "os", "random"}


def _imports(module: str) -> tuple[set[str], set[str]]:
    """(proto modules imported relatively, top-level packages imported absolutely)."""
    tree = ast.parse((PROTO / f"{module}.py").read_text())
    local, absolute = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            local |= {node.module} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            absolute.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            absolute |= {a.name.split(".")[0] for a in node.names}
    return local, absolute


def test_no_part_imports_the_facade_and_there_is_no_circle() -> None:
    graph = {m: _imports(m)[0] for m in PARTS}
    for m, deps in graph.items():
        assert "_peer" not in deps, f"{m} imports the facade"
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, f"import circle: {' -> '.join((*path, m))}"
        if m in done or m not in graph:
            return
        for d in graph[m]:
            visit(d, (*path, m))
        done.add(m)

    for m in PARTS:
        visit(m, ())


def test_proto_stays_pure() -> None:
    for path in PROTO.glob("*.py"):
        _local, absolute = _imports(path.stem)
        assert not absolute & FORBIDDEN, f"{path.name} imports {absolute & FORBIDDEN}"


def test_the_public_surface_resolves_and_carries_the_typed_reports() -> None:
    import ttpeer.proto as proto
    from ttpeer.proto import _reports

    assert len(set(proto.__all__)) == len(proto.__all__)
    for name in proto.__all__:
        assert getattr(proto, name) is not None, name
    reports = {t.__name__ for t in _reports.Report.__args__}  # type: ignore[attr-defined]
    assert reports <= set(proto.__all__) and {"JobSpec", "PeerMachine", "RETRY_AFTER"} <= set(proto.__all__)
