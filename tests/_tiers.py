"""The fast lane's rule, enforced: a test that starts a process or trains with torch is ``slow``.

``scripts/test --fast`` runs ``-m "not slow"``: the pure, property, simulator and in-process
tiers. What makes a test slow is what it does, not where it lives, so the rule is checked
while the tests run rather than trusted to a list:

- every test under ``tests/integration``, ``tests/netns`` and ``tests/gpu`` is ``slow`` by
  its directory (``SLOW_DIRS``): those tiers start real processes;
- anywhere else, a test that starts a process (any of ``WATCHED``, the audit events of
  ``subprocess``, ``os.fork``, ``os.exec*``, ``os.posix_spawn``, ``os.system``: trio's
  ``run_process`` goes through them; ``multiprocessing``'s spawn and forkserver start
  their child without one, so the function both call is watched too) or takes a torch
  optimizer step
  (``torch.optim``'s global step hook: every inner loop ends in one) must carry
  ``@pytest.mark.slow`` or a module ``pytestmark``; a test that does either unmarked fails,
  in every run (so CI's full run catches one too), and says which event and how to mark it.

Setup and teardown count as the test's: a fixture that starts a relay process makes its
tests slow. Both hooks are process-wide (an audit hook cannot be removed), so they only
record; ``pytest_runtest_makereport`` turns a record into a failure.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SLOW_DIRS = ("integration", "netns", "gpu")
WATCHED = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system",
                     "os.exec"})

_TESTS = Path(__file__).parent
_current: pytest.Item | None = None  # the unmarked test running now, if any
_seen: dict[str, list[str]] = {}  # nodeid -> what it did
_capture: list[str] | None = None  # set by capture(): tests of this guard
_torch_hooked = False


def what(event: str, args: tuple[Any, ...]) -> str | None:
    """How the guard names audit ``event``, or None when it is not one of ``WATCHED``."""
    if event not in WATCHED:
        return None
    if event == "subprocess.Popen" and len(args) > 1:
        argv = args[1] if isinstance(args[1], list | tuple) else [args[1]]
        return f"started a process ({' '.join(map(str, argv)).splitlines()[0][:100]})"
    return f"started a process ({event})"


def _note(text: str) -> None:
    if _capture is not None:
        _capture.append(text)
    elif _current is not None:
        _seen.setdefault(_current.nodeid, []).append(text)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "import":
        _hook_torch()
        return
    text = what(event, args)
    if text is not None:
        _note(text)


def _hook_torch() -> None:
    """Install the optimizer-step hook as soon as torch's optimizer module exists (an
    audit ``import`` event comes with every new module, torch's own included)."""
    global _torch_hooked
    if _torch_hooked:
        return
    mod = sys.modules.get("torch.optim.optimizer")
    register = getattr(mod, "register_optimizer_step_pre_hook", None)
    if register is None:
        return
    _torch_hooked = True
    register(lambda optimizer, args, kwargs: _note(f"trained with torch ({type(optimizer).__name__}.step)"))


@contextlib.contextmanager
def capture() -> Iterator[list[str]]:
    """What the guard sees inside the block, instead of failing the test (its own tests)."""
    global _capture
    saved, _capture = _capture, []
    try:
        yield _capture
    finally:
        _capture = saved


def is_slow_dir(path: Path) -> bool:
    try:
        rel = path.relative_to(_TESTS)
    except ValueError:
        return False
    return len(rel.parts) > 1 and rel.parts[0] in SLOW_DIRS


def _watch_multiprocessing() -> None:
    from multiprocessing import util

    spawn = util.spawnv_passfds

    def spawnv_passfds(path: Any, args: Any, passfds: Any) -> Any:
        _note(f"started a process (multiprocessing: {' '.join(map(str, args))[:100]})")
        return spawn(path, args, passfds)

    util.spawnv_passfds = spawnv_passfds


def install() -> None:
    sys.addaudithook(_audit)
    _watch_multiprocessing()
    _hook_torch()


def modify(items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow_dir(item.path) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


def start(item: pytest.Item) -> None:
    global _current
    _current = None if item.get_closest_marker("slow") else item


def stop() -> None:
    global _current
    _current = None


def verdict(item: pytest.Item, report: pytest.TestReport) -> None:
    """Fail ``report`` (the last phase of ``item``) if the unmarked test did a slow thing."""
    done = _seen.pop(item.nodeid, None)
    if not done or report.failed:
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{item.nodeid} is not marked slow, yet it {'; '.join(list(dict.fromkeys(done))[:3])}.\n"
        "A test that starts a process or trains with torch belongs to the slow tier (scripts/test --fast "
        "leaves it out): add @pytest.mark.slow, or pytestmark = pytest.mark.slow for a whole module "
        "(see tests/_tiers.py)."
    )
