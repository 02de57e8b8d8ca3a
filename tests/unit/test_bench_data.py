"""The pure parts of ``scripts/bench/data``: the generator's bytes, the sizing of pieces and
of the job, the ratio and stall arithmetic, the table and its verdicts (the run itself, real
daemons on 1 GiB, is a benchmark, not a test)."""

from __future__ import annotations

import argparse
import hashlib

import numpy as np
import pytest

from bench.data import (
    RECORD,
    PeerRow,
    auto_piece_size,
    causes,
    explain,
    generate,
    lost_guesses,
    parse_args,
    parse_size,
    plan_job,
    table,
    verdicts,
)


def test_sizes_parse_in_binary_units():
    assert [parse_size(s) for s in ("4096", "512K", "64M", "1G", "1GiB", "2m")] == [
        4096, 512 * 1024, 64 * 2**20, 2**30, 2**30, 2 * 2**20]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")


def test_the_generator_writes_the_same_bytes_for_the_same_seed(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert generate(a, 10 * RECORD + 5, seed=3) == 10 == generate(b, 10 * RECORD, seed=3)
    generate(c, 10 * RECORD, seed=4)
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (a, b, c)]
    assert a.stat().st_size == 10 * RECORD and digest[0] == digest[1] != digest[2]
    x = np.fromfile(a, dtype=np.float32).reshape(10, RECORD // 4)
    assert abs(float(x.mean())) < 0.05 and 0.9 < float(x.std()) < 1.1  # features, not zeros
    with pytest.raises(ValueError):
        generate(tmp_path / "d", RECORD, seed=0)


def test_pieces_and_the_job_are_sized_from_the_dataset():
    assert auto_piece_size(2**30) == 8 * 2**20 and auto_piece_size(64 * 2**20) == 512 * 1024
    assert auto_piece_size(RECORD) == RECORD
    plan = plan_job(2**30 // RECORD, 8 * 2**20, rounds=6, shards=3, batch=64, epoch=0.9)
    assert plan.test == 2048 and plan.steps == 203
    assert plan.trained <= 0.9 * (plan.samples - plan.test)
    assert parse_args(["--size", "64M"]).piece_size == 512 * 1024
    with pytest.raises(ValueError):
        plan_job(10, RECORD, rounds=6, shards=3, batch=64, epoch=0.9)


def test_ratio_stall_and_verdicts():
    total, size = 1000, 1000 * RECORD
    holder = PeerRow("alice", shards=6, samples=300, holder=True)
    bob = PeerRow("bob", shards=6, samples=300, fetched=330 * RECORD, waits=1, wait_s=2.5, first_s=2.5)
    carol = PeerRow("carol", shards=6, samples=300, fetched=450 * RECORD, waits=3, wait_s=4.0, first_s=3.0,
                    why={"own shards": 10, "test set": 1, "read at load": 0, "other": 4})
    assert holder.ratio(size, total) is None
    assert bob.ratio(size, total) == pytest.approx(1.1) and carol.ratio(size, total) == pytest.approx(1.5)
    assert (bob.waits_after_first, bob.stall_after_first) == (0, 0.0)
    assert (carol.waits_after_first, carol.stall_after_first) == (2, 1.0)
    said = verdicts([holder, bob, carol], size, total)
    assert said[:2] == ["- bob: bytes fetched 1.10x its share <= 1.2x: PASS",
                        "- bob: no wait for pieces after the first shard: PASS"]
    assert said[2].startswith("- carol: bytes fetched 1.50x its share > 1.2x: MISS by 0.4 MiB")
    assert "own shards 10, test set 1, other 4" in said[2]
    assert said[3].startswith("  - 1 pieces every peer holds whatever it trains (the test set's")
    assert said[4] == "  - 4 pieces none of the job's reads explain"
    assert said[5] == "- carol: 2 waits for pieces after the first shard, 1.00 s in all: MISS"
    rows = table([holder, bob, carol], size, total, 18)
    assert len(rows) == 5 and rows[0].count("|") == rows[1].count("|") == rows[3].count("|") == 12
    assert rows[2].startswith("| alice (holds the data) | 6 / 18 | 30.0% |")
    assert "| 1.10x |" in rows[3] and "| - | 2.50 s | 0 | 0.00 s |" in rows[3]
    assert PeerRow("dave").ratio(size, total) is None


def test_pieces_held_are_split_by_why_each_once():
    assert explain({0, 1, 2, 3, 7, 8, 9}, own={1, 2, 3}, test={9, 3}, load={0, 1}, others={2, 8}) == {
        "own shards": 3, "test set": 1, "read at load": 1, "others' shards": 1, "other": 1}


def test_prefetches_lost_to_other_peers_and_the_causes_said():
    shards = {(1, 0, "alice"): {4, 5, 6, 7}, (1, 2, "carol"): {7, 8, 9}, (2, 1, "alice"): {10, 11}}
    # Holds 5, 6 (and 7, its own): most of r1s0's other pieces; of r1s2's only 8; all of r2s1.
    assert lost_guesses({1, 2, 5, 6, 7, 8, 10, 11}, mine={1, 2, 7}, shards=shards, claimed={(2, 1)}) == [
        "r1s0 (alice)", "r2s1 (alice, claimed)"]
    r = PeerRow("bob", samples=300, why={"own shards": 12, "test set": 1, "read at load": 1, "others' shards": 6,
                                         "other": 0}, lost=["r1s0 (alice)"], share_pieces=10.0)
    said = causes(r)
    assert said[0].startswith("boundary pieces: its own shards read 12 pieces for 10.0 pieces' worth")
    assert "(1.20x" in said[0]
    assert said[1].startswith("2 pieces every peer holds")
    assert said[2].startswith("6 pieces read only by shards other peers trained") and "1 such shards" in said[2]
    assert len(said) == 3 and causes(PeerRow("carol")) == []
