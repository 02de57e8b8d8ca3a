"""Fixtures of the relay tests (test_relay, test_relay_hostile, test_relay_download):
a pool made of real signed records, and real relays served in the test's nursery."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from ttpeer_relay import RelayConfig, RelayRunning, serve

from .test_relay import Pool, StartRelay


@pytest.fixture
def pool() -> Pool:
    return Pool.create()


@pytest.fixture
def start_relay(nursery: trio.Nursery, tmp_path: Path) -> StartRelay:
    async def start(**overrides: object) -> RelayRunning:
        fields: dict[str, object] = {"data": tmp_path / "relay", "listen": "127.0.0.1:0"}
        fields.update(overrides)
        running: RelayRunning = await nursery.start(serve, RelayConfig(**fields))  # type: ignore[arg-type]
        return running

    return start
