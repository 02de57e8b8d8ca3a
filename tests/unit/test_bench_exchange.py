"""``scripts/bench/exchange``: the per-round figures and the issue's scale targets, from
results shaped as ``run_one`` returns them (the runs themselves take minutes)."""

from __future__ import annotations

from bench.exchange import scale_targets, summary


def _result(peers: int, path: str, egress: float, round_s: float, sent: float, init: float = 10e6) -> dict:
    # Two rounds; the relay sent every peer but the submitter the initial state once, and the
    # submitter sent it once. ``sent``: what each peer sends a round.
    rows = [{"sent": 2 * sent + (init if i == 0 else 0)} for i in range(peers)]
    return {"peers": peers, "path": path, "rate": "20mbit", "direct": "off", "rounds": 2, "init": init,
            "relay_egress": init * (peers - 1) + 2 * egress, "direct_bytes": 0, "round_s": round_s, "rows": rows,
            "slice_bits": 4 if path == "slices" else None}


def test_each_path_is_held_against_its_own_smallest_pool():
    results = [_result(2, "all deltas", 4e6, 10.0, 2e6), _result(2, "slices", 4e6, 10.0, 2e6),
               _result(16, "all deltas", 16 * 15e6, 80.0, 1e6), _result(16, "slices", 16 * 2.5e6, 14.0, 2.2e6)]
    lines = summary(results)
    assert ("| 16 | slices, 4-bit | 20mbit | off | 40.0 MB | 10.00x | 2.5 MB | 1.25x | 4.7 MB | 1.18x | 0% | 14.0 "
            "| 1.40x |") in lines
    assert ("| 2 | all deltas | 20mbit | off | 4.0 MB | 1.00x | 2.0 MB | 1.00x | 4.0 MB | 1.00x | 0% | 10.0 "
            "| 1.00x |") in lines
    targets = scale_targets(results)
    assert targets == [
        "MISS all deltas, link 20mbit, N=16 against N=2: a peer's bytes a round, sent + received 4.00x "
        "(target <= 1.3x)",
        "MISS all deltas, link 20mbit, N=16 against N=2: a peer's bytes a round, received 7.50x (target <= 1.3x)",
        "MISS all deltas, link 20mbit, N=16 against N=2: the round's time 8.00x (target <= 1.5x)",
        "PASS slices, link 20mbit, N=16 against N=2: a peer's bytes a round, sent + received 1.18x (target <= 1.3x)",
        "PASS slices, link 20mbit, N=16 against N=2: a peer's bytes a round, received 1.25x (target <= 1.3x)",
        "PASS slices, link 20mbit, N=16 against N=2: the round's time 1.40x (target <= 1.5x)",
    ]


def test_one_pool_size_has_no_target_to_meet():
    assert scale_targets([_result(4, "slices", 8e6, 12.0, 2e6)]) == []


class _Rec:
    """What ``_slice_traffic`` reads of a record: its id, author, body and fields."""

    def __init__(self, id_: str, author: str, **body) -> None:
        self.id, self.author, self.body = id_, author, body

    def __getitem__(self, key: str):
        return self.body[key]


def test_a_peers_slice_traffic_counts_its_reductions_inputs_and_the_results_it_did_not_make():
    from bench.exchange import _slice_traffic

    contribs = [_Rec(f"c{a}", a, size=3000, chunks=3) for a in "ABC"]
    ids = ["cA", "cB", "cC"]

    def piece(id_: str, author: str, s: int, sha: str, size: int = 100) -> _Rec:
        return _Rec(id_, author, round=0, slice=s, first=s, stop=s + 1, contribs=ids, sha256=sha, size=size)

    # C reduced slice 2 first and B checked it (the same hash); A's slice 0 hashed as B
    # would not matter: B made only slices 1 and 2.
    slices = [piece("a0", "A", 0, "h0"), piece("b1", "B", 1, "h1"), piece("c2", "C", 2, "h2", 90),
              piece("b2", "B", 2, "h2", 90)]
    closes = [_Rec("close", "A", slices=["a0", "b1", "c2"])]
    # B: its slice of A's and C's deltas for each of its two reductions (a third of 3000 each);
    # of the results, only A's slice 0 (its own slice 1, and slice 2 that it made too, are held).
    assert _slice_traffic("B", contribs, closes, slices) == (4 * 1000, 100, 2, 1)
    assert _slice_traffic("C", contribs, closes, slices) == (2 * 1000, 200, 1, 0)
    # The all-deltas path: no slice records, no slice traffic.
    assert _slice_traffic("A", contribs, [_Rec("close", "A")], []) == (0, 0, 0, 0)


def test_the_gossip_line_averages_each_peers_counters_a_round_in_kilobytes():
    from bench.exchange import _gossip_lines

    counters = [{"digests_in": 90_000, "records_in_new": 30_000, "records_in_held": 6_000, "digests_out": 6_000,
                 "records_out": 3_000, "answers_out": 1_500}, {"digests_in": 30_000}]
    result = {"rounds": 3, "rows": [{"gossip": c} for c in counters] + [{"gossip": {}}]}
    [_blank, line] = _gossip_lines(result)
    assert line.startswith("Gossip payloads a peer a round (before sealing): in, 20 kB of digests, 5 kB of "
                           "records new to it and 1 kB of records it held already; out, 1 kB of digests")
    assert _gossip_lines({"rounds": 3, "rows": [{"gossip": {}}]}) == []  # a version without the counters
