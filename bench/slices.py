"""``scripts/bench/slices``: bytes per peer and relay egress per round, all deltas
against aggregation slices, from the real encoder and the real sealing sizes.

Aggregation slices (issue 15, docs/ARCHITECTURE.md "Aggregation slices") are not wired
into the daemon yet; their tensor half is (``train.reduce_slice``, the ``TTD2`` chunked
delta). This measures what the protocol would move, before it is built, for N = 2, 4, 8,
16 contributions of one model: each peer's pseudo-gradient int8-encoded as ``TTD2``;
slice ``s`` (``proto._slices.slice_chunks``) reduced from the bytes of every
contribution's chunks and sent re-quantized (``train.encode_slice``). Per peer per round:

- ``all deltas``: up its delta, down every other delta (today's path);
- ``slices``: up its delta and its reduced slice, down its slice's bytes of every other
  delta and every other reduced slice. Two figures for the slice download: ``cut``, the
  delta sealed in cut pieces (``net._seal.seal_cut``: its head, then one piece per chunk),
  so a slice fetches the table, the head and exactly its chunks; and ``1MiB``, the sealed
  1 MiB pieces of today's sealing (``seal_file``) that cover the chunks' bytes (the
  index then taken to travel in the record).

Every byte is counted sealed (salt, table, one tag per piece). Relay egress is the sum of
the downloads (everything goes through the relay). The deltas are synthetic (Gaussian
pseudo-gradients with per-tensor scales, int8: the compression of real deltas within a
few percent), since what is measured is bytes, not convergence (``scripts/bench/requantize``
measures that). Also printed: the CPU time of reducing one slice against reducing the
whole mean, the work a round's close costs each aggregator.
    scripts/bench/slices [--params 16777216] [--peers 2,4,8,16] [--chunk 1048576]
"""

from __future__ import annotations

import argparse
import time

import torch

from ttpeer import train
from ttpeer._parser import DEFAULT_SLICE_BITS
from ttpeer.net._seal import CUT_HEADER, PIECE, SALT, TAG
from ttpeer.proto._slices import SLICES_FROM, slice_chunks

_STREAM_HEAD = 4 + SALT  # magic + salt of a sealed file


def sealed(size: int) -> int:
    """Bytes of ``size`` plaintext bytes sealed in pieces (``net._seal.seal_file``)."""
    return _STREAM_HEAD + size + max(1, -(-size // PIECE)) * TAG


def fetched(begin: int, end: int, total: int, *, pieces: bool) -> int:
    """Bytes downloaded for plaintext ``[begin, end)`` of a sealed blob of ``total`` bytes:
    exactly those (with their tags) or the whole 1 MiB pieces that cover them."""
    if not pieces:
        return end - begin + max(1, -(-(end - begin) // PIECE)) * TAG
    first, last = begin // PIECE, (end - 1) // PIECE
    return min(total, (last + 1) * PIECE) - first * PIECE + (last - first + 1) * TAG


def cut_sealed(index: train.ChunkIndex) -> int:
    """Bytes of a chunked delta sealed in cut pieces: the table, the head, the chunks."""
    return CUT_HEADER + 4 * (index.nchunks + 1) + index.size + (index.nchunks + 1) * TAG


def cut_fetched(index: train.ChunkIndex, first: int, stop: int) -> int:
    """Bytes a slice of chunks ``first .. stop-1`` fetches of a delta sealed in cut pieces:
    the table, the head piece, its chunks' pieces."""
    return (CUT_HEADER + 4 * (index.nchunks + 1) + index.head_size + TAG
            + sum(index.lengths[first:stop]) + (stop - first) * TAG)


def _delta(params: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(params)
    # Tensors of a few sizes with their own scales, as a model's layers have.
    offset, k = 0, 0
    while offset < params:
        size = min(params - offset, [1 << 16, 1 << 20, 1 << 18, 4096][k % 4])
        out[offset:offset + size] = torch.randn(size, generator=g) * (1e-3 * (1 + k % 7))
        offset, k = offset + size, k + 1
    return out


def measure(blobs: list[bytes], chunk: int, params: int, slice_bits: int = 8) -> dict[str, float]:
    n = len(blobs)
    indexes = [train.read_index(b, params) for b in blobs]
    runs = slice_chunks(indexes[0].nchunks, n)
    samples = [1] * n
    began = time.process_time()
    reduced = []
    for first, stop in runs:
        parts = [(i, b[slice(*i.span(first, stop))]) for i, b in zip(indexes, blobs, strict=True)]
        reduced.append(train.encode_slice(train.reduce_slice(parts, samples, first, stop), bits=slice_bits))
    reduce_all = time.process_time() - began
    reduce_one = reduce_all / len(runs)
    up_old = [sealed(len(b)) for b in blobs]
    down_old = [sum(up_old) - up_old[p] for p in range(n)]
    out = {"old_up": sum(up_old) / n, "old_down": sum(down_old) / n, "slices": len(runs),
           "reduce_one_s": reduce_one, "reduce_all_s": reduce_all}
    for pieces in (False, True):
        ups, downs = [], []
        for p in range(n):
            mine = [s for s in range(len(runs)) if s % n == p]  # slice s goes to the s-th author
            up = (sealed(len(blobs[p])) if pieces else cut_sealed(indexes[p])) + sum(
                sealed(len(reduced[s])) for s in mine)
            down = sum(fetched(*indexes[q].span(*runs[s]), len(blobs[q]), pieces=True) if pieces
                       else cut_fetched(indexes[q], *runs[s]) for s in mine for q in range(n) if q != p)
            down += sum(sealed(len(reduced[s])) for s in range(len(runs)) if s not in mine)
            ups.append(up)
            downs.append(down)
        key = "pieces" if pieces else "cut"
        out[f"{key}_up"], out[f"{key}_down"] = sum(ups) / n, sum(downs) / n
        out[f"{key}_egress"] = float(sum(downs))
    out["old_egress"] = float(sum(down_old))
    out["delta"] = sum(len(b) for b in blobs) / n
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench/slices", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=1 << 24,
                    help="parameters of the model (default 16777216: 16 chunks, one slice per peer at N = 16)")
    ap.add_argument("--peers", default="2,4,8,16", help="contributions per round, comma-separated (default 2,4,8,16)")
    ap.add_argument("--chunk", type=int, default=1 << 20,
                    help="values per chunk of the TTD2 delta, a power of two (default 1048576)")
    ap.add_argument("--slice-bits", type=int, choices=[3, 4, 8], default=DEFAULT_SLICE_BITS,
                    help=f"the reduced slices' bits (default {DEFAULT_SLICE_BITS}, as ttpeer submit's)")
    args = ap.parse_args(argv)
    try:
        peers = [int(p) for p in args.peers.split(",")]
    except ValueError:
        ap.error(f"--peers must be whole numbers separated by commas, got {args.peers!r}")
    if any(p < 2 for p in peers):
        ap.error(f"--peers: a round needs at least 2 contributions, got {args.peers!r}")
    if args.params < args.chunk:
        ap.error(f"--params ({args.params}) must be at least one chunk ({args.chunk}) to cut into slices")
    torch.set_num_threads(1)
    blobs: list[bytes] = []
    try:
        for p in range(max(peers)):
            data, _r = train.encode_delta({"v": _delta(args.params, p)}, None, chunk=args.chunk)
            blobs.append(data)
    except ValueError as exc:
        ap.error(f"--chunk: {exc}")
    mb = 1e6
    rows = {n: measure(blobs[:n], args.chunk, args.params, args.slice_bits) for n in peers}
    print(f"model {args.params} parameters, int8 delta {rows[peers[0]]['delta'] / mb:.2f} MB, "
          f"chunks of {args.chunk} values, reduced slices at {args.slice_bits} bits; MB per peer per round "
          "(up + down), relay egress MB per round")
    print(f"{'N':>3} {'slices':>6} | {'all deltas':>10} {'egress':>8} | {'slices cut':>12} {'egress':>8} | "
          f"{'slices 1MiB':>11} {'egress':>8} | {'reduce 1 slice':>14} {'whole mean':>10}")
    for n, r in rows.items():
        print(f"{n:>3} {r['slices']:>6} | {(r['old_up'] + r['old_down']) / mb:>10.1f} {r['old_egress'] / mb:>8.1f} | "
              f"{(r['cut_up'] + r['cut_down']) / mb:>12.1f} {r['cut_egress'] / mb:>8.1f} | "
              f"{(r['pieces_up'] + r['pieces_down']) / mb:>11.1f} {r['pieces_egress'] / mb:>8.1f} | "
              f"{r['reduce_one_s']:>13.2f}s {r['reduce_all_s']:>9.2f}s")
    lo, hi = min(peers), max(peers)
    if lo != hi:
        def per_peer(r: dict[str, float], key: str) -> float:
            return r[f"{key}_up"] + r[f"{key}_down"]
        chosen_lo = "cut" if lo >= SLICES_FROM else "old"
        for key, name in (("cut", "slices cut"), ("pieces", "slices 1MiB")):
            print(f"per-peer bytes N={hi} / N={lo}: {name} {per_peer(rows[hi], key) / per_peer(rows[lo], key):.2f}x "
                  f"against its own N={lo}, {per_peer(rows[hi], key) / per_peer(rows[lo], chosen_lo):.2f}x against "
                  f"the path chosen at N={lo} (target 1.3x); all deltas "
                  f"{per_peer(rows[hi], 'old') / per_peer(rows[lo], 'old'):.2f}x")
        # Linear in N: egress / N bounded. All deltas: N-1 deltas per peer; slices: 2(N-1)/N.
        for key, name in (("old", "all deltas"), ("cut", "slices cut"), ("pieces", "slices 1MiB")):
            per = [rows[n][f"{key}_egress"] / n / rows[n]["delta"] for n in peers]
            print(f"relay egress / N, in deltas ({name}): "
                  + ", ".join(f"N={n} {v:.2f}" for n, v in zip(peers, per, strict=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
