"""Every simulator test runs inside ``deterministic(seed)``: trio's scheduler order and
all keys and nonces come from one seed per test, so the in-memory relay's fault plan
(``Faults``, keyed on per-pair message counts) is the same on every run. Without it
trio reversed ready tasks at random and each run drew another plan: a rare failure
could not be replayed.

The seed is a hash of the test's id (stable across runs and machines); set
TTPEER_SIM_SEED to try another one. A failing test's report shows its seed. Replaying
in another process also needs the same PYTHONHASHSEED (see ``deterministic``)."""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator

import pytest

from ttpeer.testing import deterministic


@pytest.fixture(autouse=True)
def sim_seed(request: pytest.FixtureRequest) -> Iterator[int]:
    override = os.environ.get("TTPEER_SIM_SEED")
    seed = int(override) if override else zlib.crc32(request.node.nodeid.encode())
    hash_seed = os.environ.get("PYTHONHASHSEED", "random")
    request.node.add_report_section(
        "setup", "sim seed", f"TTPEER_SIM_SEED={seed} PYTHONHASHSEED={hash_seed} (replay: set both)")
    with deterministic(seed):
        yield seed
