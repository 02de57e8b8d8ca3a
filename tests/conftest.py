"""The tiers: ``slow`` (processes, torch training) and the rest, the fast lane
(``scripts/test --fast``). The rule and its guard are in ``tests/_tiers.py``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import _tiers


def pytest_configure(config: pytest.Config) -> None:
    # matplotlib (which mnist1d imports) builds its font cache on its first import on a
    # machine, running fc-list: done here, before any test, that is no test's process.
    with contextlib.suppress(ImportError):
        import matplotlib.font_manager  # noqa: F401
    _tiers.install()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _tiers.modify(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _tiers.start(item)
    try:
        return (yield)
    finally:
        _tiers.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report = yield
    if call.when == "teardown":
        _tiers.verdict(item, report)
    return report


@pytest.fixture(scope="session")
def builtin_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data folder for the session's built-in tasks: generating mnist1d takes 10-20 s
    on the 2-core machine, so tests that only read it share one copy (the tests of the
    cache itself use their own folders)."""
    return tmp_path_factory.mktemp("builtin-data")
