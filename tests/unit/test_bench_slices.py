"""``scripts/bench/slices``: the byte accounting, and a short run."""

from __future__ import annotations

import pytest
import torch

from bench.slices import PIECE, TAG, fetched, main, measure, sealed
from ttpeer import train


def test_a_range_costs_its_bytes_or_the_pieces_that_cover_it():
    total = 5 * PIECE + 100
    assert fetched(10, 20, total, pieces=False) == 10 + TAG
    assert fetched(10, 20, total, pieces=True) == PIECE + TAG  # one whole piece
    assert fetched(PIECE - 1, PIECE + 1, total, pieces=True) == 2 * (PIECE + TAG)  # straddles two
    assert fetched(5 * PIECE, total, total, pieces=True) == 100 + TAG  # the short last piece
    assert sealed(0) == sealed(1) - 1 and sealed(2 * PIECE) == 20 + 2 * PIECE + 2 * TAG


def _blobs(n: int, params: int = 1 << 15, chunk: int = 4096) -> list[bytes]:
    out = []
    for p in range(n):
        values = torch.randn(params, generator=torch.Generator().manual_seed(p)) * 1e-3
        out.append(train.encode_delta({"v": values}, None, chunk=chunk)[0])
    return out


@pytest.mark.parametrize("n", [3, 8])
def test_the_slice_path_moves_what_the_arithmetic_says(n):
    blobs = _blobs(n)
    r = measure(blobs, 4096, 1 << 15)
    d = r["delta"]
    assert r["slices"] == n and r["old_up"] + r["old_down"] == pytest.approx(n * d, rel=0.01)
    # Up: a delta and a reduced slice (1 + 1/N); down: its slice of N-1 deltas and N-1 reduced slices.
    assert r["cut_up"] + r["cut_down"] == pytest.approx(((1 + 1 / n) + 2 * (n - 1) / n) * d, rel=0.05)
    assert r["pieces_up"] + r["pieces_down"] >= r["cut_up"] + r["cut_down"]
    assert r["cut_egress"] == pytest.approx(n * r["cut_down"])


def test_a_short_run_prints_the_table_and_bad_arguments_are_usage_errors(capsys):
    assert main(["--params", "16384", "--chunk", "4096", "--peers", "2,4"]) == 0
    out = capsys.readouterr().out
    assert "all deltas" in out and "per-peer bytes N=4 / N=2" in out and out.count("\n") >= 8
    for bad in (["--peers", "1,4"], ["--peers", "two"], ["--params", "100"], ["--chunk", "1000", "--params", "4096"]):
        with pytest.raises(SystemExit) as exc:
            main(bad)
        assert exc.value.code == 2
