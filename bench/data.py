"""The data benchmark behind ``scripts/bench/data`` (issue 17).

Three ``ttpeer`` processes on loopback and a relay. Alice adds a generated dataset (1 GiB by
default) with ``ttpeer data add --format records:4096``; bob and carol hold none of it. One
job reads it with ``dataset_samples`` and trains about 0.9 of an epoch across the pool, so
each peer should fetch only the pieces of the shards it trains (and the test set's).

The data: ``size // 4096`` records, each 1024 float32 features drawn from a seeded normal
generator (the same bytes on every run); the task's transform reads a record with
``torch.frombuffer`` and labels it 1 when its first 512 features sum to more than its last
512 (a linear rule, so the accuracy says the model learned). The last piece's worth of
samples is the test set. Compute is emulated: every peer runs with ``--slowdown S`` (each
batch lasts ``1 + S`` times its real duration), so that a shard lasts long enough for the
next one's pieces to be prefetched behind it.

A round has as many shards as there are peers: the daemon's look-ahead prefetches, while a
shard trains, the pieces of the one shard of the next round this peer expects to claim,
so a peer training two shards of one round would wait for the second by design.

Measured per peer, from ``ttpeer status --json`` and the records log: shards and samples
trained, bytes fetched, bytes fetched / (share of the data it trained x dataset bytes)
(target <= 1.2x), how long its first shard waited for pieces and every wait after it
(target: none after the first). Where a ratio is over, the pieces it holds are split by
why (its own shards' pieces, the test set's, those the task reads when it loads, the rest:
prefetched for a shard another peer trained), computed from the job's schedule.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

RECORD = 4096  # bytes per sample: 1024 float32 features
FEATURES = RECORD // 4
PEERS = ("alice", "bob", "carol")
RATIO_TARGET = 1.2
_CHUNK = 1 << 22  # floats generated at a time: part of what makes the bytes what they are

TASK = '''
import torch
import torch.nn.functional as F
from torch import nn
from ttpeer.train import TaskSpec, dataset_samples

FEATURES = {features}


def parse(raw):
    x = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    return x, int(x[:FEATURES // 2].sum() > x[FEATURES // 2:].sum())


def task():
    train, test = dataset_samples("synth", transform=parse).split(test={test})
    return TaskSpec(model=lambda: nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 2)),
                    train=train, test=test, loss=F.cross_entropy, metric_name="accuracy",
                    metric=lambda o, t: (o.argmax(-1) == t).float().mean().item(), batch_size={batch})
'''


# -- pure parts (tests/unit/test_bench_data.py) ------------------------------------------------

def parse_size(text: str) -> int:
    """``64M``, ``1G``, ``1GiB``, ``512K``, ``4096``: bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64M, 1G)")
    return int(m[1]) * 1024 ** "_KMG".index((m[2] or "_").upper())


def generate(path: Path, size: int, seed: int) -> int:
    """Write ``size // RECORD`` records of seeded float32 noise to ``path``; the sample count.
    The same ``size`` and ``seed`` give the same bytes."""
    samples = size // RECORD
    if samples < 2:
        raise ValueError(f"--size {size} holds fewer than 2 samples of {RECORD} bytes")
    rng = np.random.default_rng(seed)
    left = samples * FEATURES
    with open(path, "wb") as f:
        while left:
            n = min(left, _CHUNK)
            rng.standard_normal(n, dtype=np.float32).tofile(f)
            left -= n
    return samples


def auto_piece_size(size: int) -> int:
    """The largest power of two <= size / 128, at least one record: 8 MiB for 1 GiB, so a
    shard covers several pieces and the dataset record stays under its ~450 pieces."""
    piece = RECORD
    while piece * 2 <= size // 128:
        piece *= 2
    return piece


@dataclass(frozen=True)
class Plan:
    samples: int
    test: int
    rounds: int
    shards: int
    steps: int
    batch: int

    @property
    def trained(self) -> int:
        return self.rounds * self.shards * self.steps * self.batch


def plan_job(samples: int, piece: int, rounds: int, shards: int, batch: int, epoch: float) -> Plan:
    """A piece's worth of samples held out for test (at least one batch); inner steps sized
    so the job trains ``epoch`` of the training samples in all."""
    test = max(batch, piece // RECORD)
    train = samples - test
    steps = int(epoch * train / (rounds * shards * batch))
    if train < 1 or steps < 1:
        raise ValueError(f"{samples} samples are too few for {rounds} rounds x {shards} shards x batch {batch}")
    return Plan(samples, test, rounds, shards, steps, batch)


@dataclass
class PeerRow:
    name: str
    shards: int = 0
    samples: int = 0
    fetched: int = 0
    direct: int = 0  # of ``fetched``, from members directly (the LAN shortcut), not the relay
    pieces_here: int = 0
    pieces: int = 0
    here: str = ""
    bad: int = 0
    waits: int = 0
    wait_s: float = 0.0
    first_s: float | None = None
    holder: bool = False
    trains_from: float | None = None  # s after submit its first shard trained (status polled at 2 Hz)
    why: dict[str, int] = field(default_factory=dict)  # pieces held, by why (``explain``)
    lost: list[str] = field(default_factory=list)  # shards others trained it prefetched for (``lost_guesses``)
    share_pieces: float = 0.0  # its share of the data in pieces: what its own shards' pieces compare to

    def share(self, total_samples: int) -> float:
        return self.samples / total_samples if total_samples else 0.0

    def ratio(self, dataset_bytes: int, total_samples: int) -> float | None:
        """Bytes fetched / (share of the data trained x dataset bytes); None for the holder or
        a peer that trained nothing."""
        want = self.share(total_samples) * dataset_bytes
        return None if self.holder or want <= 0 else self.fetched / want

    @property
    def stall_after_first(self) -> float:
        return max(0.0, self.wait_s - (self.first_s or 0.0))

    @property
    def waits_after_first(self) -> int:
        return max(0, self.waits - 1)


def explain(held: set[int], own: set[int], test: set[int], load: set[int], others: set[int]) -> dict[str, int]:
    """The pieces held, each counted once, in this order of why: read by this peer's own
    shards, by the test set, by the task when it loads (its first batches), by shards
    other peers trained (prefetched for a shard another peer claimed), else none of these."""
    out, left = {}, set(held)
    for why, pieces in (("own shards", own), ("test set", test), ("read at load", load),
                        ("others' shards", others)):
        out[why] = len(left & pieces)
        left -= pieces
    out["other"] = len(left)
    return out


def lost_guesses(held: set[int], mine: set[int], shards: dict[tuple[int, int, str], set[int]],
                 claimed: set[tuple[int, int]] = frozenset()) -> list[str]:  # type: ignore[assignment]
    """The shards other peers trained of which this peer holds most of the pieces that none
    of its own reads (``mine``) explain: prefetched for a shard another peer then claimed.
    ``shards``: (round, shard, who trained it) -> the pieces it read; ``claimed``: the
    (round, shard) this peer signed claims for. ``r2s1 (alice)`` each, ``, claimed`` added."""
    out = []
    for (rnd, shard, who), pieces in sorted(shards.items()):
        only = pieces - mine
        if only and 2 * len(only & held) > len(only):
            out.append(f"r{rnd}s{shard} ({who}{', claimed' if (rnd, shard) in claimed else ''})")
    return out


def verdicts(rows: list[PeerRow], dataset_bytes: int, total_samples: int,
             target: float = RATIO_TARGET) -> list[str]:
    lines = []
    for r in rows:
        if r.holder:
            continue
        ratio = r.ratio(dataset_bytes, total_samples)
        if ratio is None:
            lines.append(f"- {r.name}: trained nothing, so no ratio (fetched {_mib(r.fetched)})")
        elif ratio <= target:
            lines.append(f"- {r.name}: bytes fetched {ratio:.2f}x its share <= {target}x: PASS")
        else:
            extra = r.fetched - target * r.share(total_samples) * dataset_bytes
            lines.append(f"- {r.name}: bytes fetched {ratio:.2f}x its share > {target}x: MISS by {_mib(extra)}"
                         + (f" (pieces held, by why: {_why(r.why)})" if r.why else ""))
            lines += [f"  - {cause}" for cause in causes(r)]
        if r.waits_after_first == 0:
            lines.append(f"- {r.name}: no wait for pieces after the first shard: PASS")
        else:
            lines.append(f"- {r.name}: {r.waits_after_first} waits for pieces after the first shard, "
                         f"{r.stall_after_first:.2f} s in all: MISS")
    return lines


def causes(r: PeerRow) -> list[str]:
    """Why a peer fetched more than its share, from its ``why``, ``lost`` and ``share_pieces``."""
    if not r.why:
        return []
    out = []
    own = r.why.get("own shards", 0)
    if r.share_pieces and own > r.share_pieces:
        out.append(f"boundary pieces: its own shards read {own} pieces for {r.share_pieces:.1f} pieces' worth of "
                   f"samples ({own / r.share_pieces:.2f}x: a shard's first and last pieces are shared with "
                   "the shards next to it in the schedule)")
    fixed = r.why.get("test set", 0) + r.why.get("read at load", 0)
    if fixed:
        out.append(f"{fixed} pieces every peer holds whatever it trains (the test set's, and those the task "
                   "reads when it loads)")
    if lost := r.why.get("others' shards"):
        out.append(f"{lost} pieces read only by shards other peers trained: prefetched for a shard another peer "
                   f"then claimed, or claimed and cancelled here ({len(r.lost)} such shards mostly held: "
                   f"{', '.join(r.lost) or 'none'}; 'claimed': this peer signed a claim for it too)")
    if r.why.get("other"):
        out.append(f"{r.why['other']} pieces none of the job's reads explain")
    return out


def table(rows: list[PeerRow], dataset_bytes: int, total_samples: int, total_shards: int) -> list[str]:
    out = ["| peer | shards trained | share of samples | bytes fetched | fetched / (share x data) | pieces here "
           "| trains from | first shard's wait | waits after it | stall after it | pieces held, by why |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r.ratio(dataset_bytes, total_samples)
        first = "-" if r.first_s is None else f"{r.first_s:.2f} s"
        out.append(f"| {r.name}{' (holds the data)' if r.holder else ''} | {r.shards} / {total_shards} "
                   f"| {r.share(total_samples):.1%} | {_mib(r.fetched)}"
                   f"{f' ({_mib(r.direct)} direct)' if r.direct else ''} | "
                   f"{'-' if ratio is None else f'{ratio:.2f}x'} | {r.pieces_here} / {r.pieces} ({r.here}) "
                   f"| {'-' if r.trains_from is None else f'{r.trains_from:.1f} s'} "
                   f"| {first} | {r.waits_after_first} | {r.stall_after_first:.2f} s "
                   f"| {'-' if r.holder or not r.why else _why(r.why)} |")
    return out


def _why(why: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in why.items() if v)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


# -- the run ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/bench/data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"), help="dataset bytes (default 1G)")
    ap.add_argument("--piece-size", type=parse_size, default=None,
                    help="data add --piece-size (default: size / 128 as a power of two, 8M for 1G)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epoch", type=float, default=0.9, help="fraction of an epoch the job trains (default 0.9)")
    ap.add_argument("--slowdown", type=float, default=4.0,
                    help="every peer's batches last 1 + S times as long (emulated compute; default 4)")
    ap.add_argument("--lease", default="120s", help="the job's lease (default 120s: a first fetch fits)")
    ap.add_argument("--seed", type=int, default=17, help="the generator's seed")
    ap.add_argument("--direct", default="auto", choices=["auto", "off"],
                    help="the peers' direct setting (off: every piece through the relay; default auto)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)
    if args.piece_size is None:
        args.piece_size = auto_piece_size(args.size)
    return args


def main(argv: list[str] | None = None) -> int:
    from ttpeer_harness import make_pool, temporary_cluster, ttpeer

    args = parse_args(argv)
    began = time.monotonic()
    with temporary_cluster(args.keep) as cluster:
        t = time.monotonic()
        samples = generate(cluster.root / "synth.bin", args.size, args.seed)
        size = samples * RECORD
        gen_s = time.monotonic() - t
        plan = plan_job(samples, args.piece_size, args.rounds, len(PEERS), args.batch, args.epoch)
        url, fp = cluster.start_relay()
        homes = make_pool(cluster, url, fp, list(PEERS), ("--slowdown", repr(args.slowdown), "--direct", args.direct))
        t = time.monotonic()
        ttpeer("data", "add", str(cluster.root / "synth.bin"), "--name", "synth", "--piece-size",
               str(args.piece_size), "--format", f"records:{RECORD}", "--home", str(homes[0]))
        add_s = time.monotonic() - t
        task = cluster.root / "synth_task.py"
        task.write_text(textwrap.dedent(TASK.format(features=FEATURES, test=plan.test, batch=plan.batch)))
        t = time.monotonic()
        job = ttpeer("submit", "--task", str(task), "--rounds", str(plan.rounds), "--shards", str(plan.shards),
                     "--inner-steps", str(plan.steps), "--batch-size", str(plan.batch), "--lease", args.lease,
                     "--home", str(homes[0]))[-1]
        seen = _wait_done(homes, job, timeout=1800)
        job_s = time.monotonic() - t
        rows, accuracy = _collect(homes, job, plan)
        for row in rows:
            row.trains_from = seen[row.name]["trains_from"]
    total_shards = plan.rounds * plan.shards
    pieces = rows[0].pieces
    print(f"\n3 peers on loopback; alice adds {_mib(size)} of generated records ({samples} samples of {RECORD} "
          f"bytes, {pieces} pieces of {_mib(args.piece_size)}); bob and carol hold none.\n"
          f"Job: {plan.rounds} rounds x {plan.shards} shards x {plan.steps} steps x batch {plan.batch} = "
          f"{plan.trained} samples ({plan.trained / (samples - plan.test):.0%} of the {samples - plan.test} training "
          f"samples), test set the last {plan.test}. Compute emulated: every peer --slowdown {args.slowdown:g} "
          f"(batches last {1 + args.slowdown:g}x their real time).\n")
    for line in table(rows, size, samples, total_shards):
        print(line)
    print(f"\ngenerate {gen_s:.1f} s, data add {add_s:.1f} s, job {job_s:.1f} s (submit to done on every peer), "
          f"test accuracy {accuracy if accuracy is None else f'{accuracy:.3f}'}; whole run "
          f"{time.monotonic() - began:.1f} s")
    print("'share' is of the dataset's samples; 'first shard's wait' and the stall are status' data_wait "
          "(shards that had to wait for pieces while training).\n")
    for name, what in seen.items():
        if what["phases"]:
            first = list(what["phases"].items())[:8]
            print(f"{name} before its first shard: " + "; ".join(f"{t:.1f} s {p}" for p, t in first))
    print()
    for line in verdicts(rows, size, samples):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({
            "size": size, "samples": samples, "piece_size": args.piece_size, "plan": asdict(plan),
            "slowdown": args.slowdown, "direct": args.direct, "generate_s": gen_s, "add_s": add_s, "job_s": job_s,
            "accuracy": accuracy,
            "peers": [asdict(r) | {"ratio": r.ratio(size, samples)} for r in rows], "seen": seen}, indent=2))
    return 0


def _wait_done(homes: list[Path], job: str, timeout: float) -> dict[str, dict[str, Any]]:
    """Wait for every peer to finish ``job``; per peer, when (s after the call) it first trained
    a shard and the phases it went through before (first seen)."""
    from ttpeer_harness import status, wait_for

    t0 = time.monotonic()
    seen: dict[str, dict[str, Any]] = {name: {"trains_from": None, "phases": {}} for name in PEERS}

    def done() -> bool:
        finished = True
        for name, home in zip(PEERS, homes, strict=True):
            j = next((j for j in status(home)["jobs"] if j["id"] == job), None)
            now = round(time.monotonic() - t0, 1)
            if j is not None and j["state"] == "failed":
                raise SystemExit(f"the job failed: {j.get('declines')}")
            if j is not None and j["phase"] and seen[name]["trains_from"] is None:
                seen[name]["phases"].setdefault(j["phase"], now)
            if j is not None and j["training_shard"] is not None and seen[name]["trains_from"] is None:
                seen[name]["trains_from"] = now
            finished = finished and j is not None and j["state"] == "done"
        return finished

    wait_for(done, timeout, "the three peers to finish the job", poll=0.5)
    return seen


def _collect(homes: list[Path], job: str, plan: Plan) -> tuple[list[PeerRow], float | None]:
    from ttpeer.daemon.service._integrity import scan_log
    from ttpeer.proto import parse
    from ttpeer_harness import status

    states = [status(h) for h in homes]
    by_node = {st["node"]["id"]: name for st, name in zip(states, PEERS, strict=True)}
    records = [parse(raw) for raw in scan_log((homes[0] / "records.log").read_bytes()).frames]
    rows = {name: PeerRow(name, holder=name == PEERS[0]) for name in PEERS}
    trained: dict[str, list[tuple[int, int]]] = {name: [] for name in PEERS}
    claims: dict[str, set[tuple[int, int]]] = {name: set() for name in PEERS}
    for r in records:
        if r.kind == "claim" and r["job"] == job and r.author in by_node:
            claims[by_node[r.author]].add((r["round"], r["shard"]))
        if r.kind == "contrib" and r["job"] == job and r.author in by_node:
            row = rows[by_node[r.author]]
            row.shards += len(r["shards"])
            row.samples += r["samples"]
            trained[row.name] += [(r["round"], s) for s in r["shards"]]
    accuracy = None
    for st, name in zip(states, PEERS, strict=True):
        j = next(j for j in st["jobs"] if j["id"] == job)
        accuracy = j["eval_metric"] if accuracy is None else accuracy
        [d] = j["data"]
        row = rows[name]
        row.fetched, row.pieces_here, row.pieces, row.here, row.bad = (
            d["fetched_bytes"], d["pieces_here"], d["pieces"], d["here"], d["bad_pieces"])
        row.direct = d.get("direct_bytes", 0)
        if j["data_wait"]:
            row.waits, row.wait_s, row.first_s = (j["data_wait"]["waits"], j["data_wait"]["seconds"],
                                                  j["data_wait"]["first_s"])
    try:
        _explain(rows, trained, claims, records, homes, job, plan)
    except (OSError, ValueError, KeyError) as exc:  # a diagnosis, not a figure: say so and go on
        print(f"(could not split the pieces held by why: {exc})")
    return list(rows.values()), accuracy


def _explain(rows: dict[str, PeerRow], trained: dict[str, list[tuple[int, int]]],
             claims: dict[str, set[tuple[int, int]]], records: list[Any],
             homes: list[Path], job: str, plan: Plan) -> None:
    """Fill each fetching peer's ``why``: its pieces held, by the schedule's reason for them."""
    from ttpeer_wire import record_files

    from ttpeer.train import piece_shard_indices
    from ttpeer.train._samples import SampleIndex

    [rec] = [r for r in records if r.kind == "job" and r.id == job]
    dataset = rec["datasets"]["synth"]
    src = next(r for r in records if r.kind == "dataset" and r["id"] == dataset)
    files = [(p, s) for p, s, _h in record_files(src.body)]
    index = SampleIndex("synth", dataset, "", Path("."), int(src["piece_size"]), files, dict(src["samples"]))
    n_train = index.total - plan.test
    counts = index.piece_counts(0, n_train)

    def pieces_of(indices: Any) -> set[int]:
        return {k for i in indices for k in index.pieces_of(i)}

    test = pieces_of(range(n_train, index.total))
    load = pieces_of(range(min(plan.batch, n_train))) | pieces_of(range(n_train, n_train + plan.batch))
    read: dict[str, set[int]] = {}
    each: dict[tuple[int, int, str], set[int]] = {}
    for name, shards in trained.items():
        read[name] = set()
        for rnd, shard in shards:
            batches = piece_shard_indices(counts, rec["seed"], rnd, shard, rec["shards"], rec["batches"],
                                          rec["batch_size"])
            each[(rnd, shard, name)] = pieces_of(i for b in batches for i in b)
            read[name] |= each[(rnd, shard, name)]
    for name, home in zip(PEERS, homes, strict=True):
        row = rows[name]
        if not row.holder:
            held = _held(home / "datasets", dataset, len(index._pieces))
            others = set().union(*(pieces for who, pieces in read.items() if who != name))
            row.why = explain(held, read[name], test, load, others)
            row.lost = lost_guesses(held, read[name] | test | load,
                                    {k: v for k, v in each.items() if k[2] != name}, claims[name])
            row.share_pieces = row.samples * RECORD / int(src["piece_size"])


def _held(root: Path, dataset: str, pieces: int) -> set[int]:
    """The pieces of ``dataset`` verified in a home's datasets folder (all, once complete)."""
    if (root / dataset / "meta.json").is_file():
        return set(range(pieces))
    return {int(k) for k in json.loads((root / f"{dataset}.part" / "done.json").read_text())}


if __name__ == "__main__":
    sys.exit(main())
