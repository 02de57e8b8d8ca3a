"""The guard of the fast lane (tests/_tiers.py) sees what makes a test slow."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import _tiers


def test_every_way_to_start_a_process_is_watched():
    with _tiers.capture() as seen:
        # The audit events themselves, raised by hand: the guard cannot tell them from the real ones.
        sys.audit("subprocess.Popen", "/bin/true", ["/bin/true", "x"], None, None)
        sys.audit("os.fork")
        sys.audit("os.posix_spawn", "/bin/true", ["/bin/true"], None)
        sys.audit("os.system", b"true")
        sys.audit("os.exec", "/bin/true", ["/bin/true"], None)
        sys.audit("open", "/dev/null", "r", 0)  # not a process
    assert seen == ["started a process (/bin/true x)", "started a process (os.fork)",
                    "started a process (os.posix_spawn)", "started a process (os.system)",
                    "started a process (os.exec)"]


def test_multiprocessing_without_fork_is_watched_too():
    # spawn and forkserver start their child through this function, with no audit event.
    import os
    from multiprocessing import util

    with _tiers.capture() as seen:
        pid = util.spawnv_passfds(b"/bin/true", ["/bin/true"], ())  # the path as multiprocessing gives it
    os.waitpid(pid, 0)
    assert seen == ["started a process (multiprocessing: /bin/true)"]


def test_an_optimizer_step_is_training():
    torch = pytest.importorskip("torch")
    w = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    w.sum().backward()
    with _tiers.capture() as seen:
        opt.step()
    assert seen == ["trained with torch (SGD.step)"]


def test_the_process_tiers_are_slow_by_directory():
    tests = Path(_tiers.__file__).parent
    assert _tiers.is_slow_dir(tests / "integration" / "test_processes.py")
    assert _tiers.is_slow_dir(tests / "netns" / "test_netlab.py")
    assert not _tiers.is_slow_dir(tests / "unit" / "test_cli.py")
    assert not _tiers.is_slow_dir(tests / "sim" / "integration.py")
