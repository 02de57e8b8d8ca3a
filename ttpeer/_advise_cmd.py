"""``ttpeer advise``: before a run, measure what the prediction of ``_advise`` needs.

Three measurements, each bounded, each said plainly when it was assumed instead:

- the job's inner step on the device the daemon would use (the ``device`` setting:
  cuda if present, else cpu), through the real ``InnerTrainer`` at the job's batch, and
  one real delta of those steps encoded at ``--bits`` (its wire size);
- the link to the pool's relay of ``--home``, unless ``--link`` and ``--rtt`` are given:
  the daemon's own pinned ``RelayClient`` logs in, times small requests (the round
  trip) and a 1 MiB blob put and get (the rates; the relay expires the blob);
- the scaling probe (``--quick`` skips it): eval-loss curves at batch B and k*B side
  by side in this process, cut at ``--probe-seconds``, give g(k).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ttpeer import _advise
from ttpeer._parser import (
    DEFAULT_BITS,
    DEFAULT_CHUNK,
    DEFAULT_SLICE_BITS,
    chunk_of,
    chunk_values,
    slice_bits_of,
    slice_min_of,
)
from ttpeer.errors import UsageError

PROBE_BYTES = 1 << 20  # the blob timed to and from the relay
LINK_TIMEOUT = 20.0  # seconds for the whole link measurement
MAX_PEERS = 64
FIRST_BLOCK, MAX_PROBE_STEPS = 10, 2000  # the probe's steps at batch B: its first block, at most
PROBE_LR, PROBE_WEIGHT_DECAY = 1e-3, 0.01  # the job defaults (submit --inner-lr, --weight-decay)
REDUCED_SAMPLE = 1 << 20  # values encoded to size a reduced model (``reduced_size``)


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    a = sub.add_parser(
        "advise", parents=[common], help="before a run: will N machines finish this job sooner, and why",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure the job's step on this machine, the link to the pool's relay and how much\n"
                    "the task gains from a larger batch (the scaling probe, about a minute); then predict,\n"
                    "for 1..N peers, the sync, the inner steps a round needs to hide it (as --inner-steps\n"
                    "auto sizes rounds) and the time to the same loss against one machine, and say in one\n"
                    "sentence whether N machines help. Every figure it did not measure, it says it assumed.",
        epilog="examples:\n  ttpeer advise --task mnist1d --peers 3\n"
               "  ttpeer advise --task charlm --peers 8 --link 20mbit --rtt 50 --quick\n"
               "  ttpeer advise --task charlm --peers 8 --link 20mbit --rtt 50 --quick --no-slices\n"
               "  ttpeer advise --task my_task.py --peers 4 --no-overlap --bits 8")
    a.add_argument("--task", required=True,
                   help="as for submit: 'mnist1d[:samples=N]', 'charlm[:key=int,...]' or a task file path/to/task.py")
    a.add_argument("--peers", type=_arg(_within(1, MAX_PEERS, int)), default=2, metavar="N",
                   help=f"machines to ask about, 1-{MAX_PEERS} (default 2); the table has a row per count 1..N")
    a.add_argument("--link", type=_arg(_advise.parse_link), default=None, metavar="RATE",
                   help=f"each machine's link, both ways: {_advise.LINK_FORMS} (default: measured to the "
                        "relay of --home's pool; with no pool, 20mbit assumed)")
    a.add_argument("--rtt", type=_arg(_advise.parse_rtt), default=None, metavar="MS",
                   help="round trip to the relay in milliseconds, more than 0 (default: measured, as --link; "
                        "else 50 assumed)")
    a.add_argument("--quick", action="store_true",
                   help="skip the scaling probe (about a minute): assume a data-parallel gain of sqrt(k)")
    a.add_argument("--batch-size", type=_arg(_within(1, 1_000_000, int)), default=64, metavar="B",
                   help="the job's batch (default 64, as submit's)")
    a.add_argument("--bits", type=int, choices=[4, 8], default=DEFAULT_BITS,
                   help=f"delta quantization (default {DEFAULT_BITS}, as submit's)")
    a.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="rounds train while the last one's deltas travel, as submit's default (--no-overlap: "
                        "every round waits, as 'submit --no-overlap')")
    a.add_argument("--slices", type=chunk_values, nargs="?", const=DEFAULT_CHUNK, default=None, metavar="VALUES",
                   help="as submit's --slices: a round of three or more peers closes from aggregation slices "
                        f"of chunks of VALUES values (default {DEFAULT_CHUNK}) wherever it can; by default, as "
                        "submit's, only where that saves each peer 1 MiB a round; the table's path column says "
                        "which rows slice")
    a.add_argument("--no-slices", action="store_true",
                   help="predict 'submit --no-slices': every round closes from all deltas")
    a.add_argument("--slice-bits", type=int, choices=[3, 4, 8], default=None,
                   help=f"with slices: the reduced slices' bits (default {DEFAULT_SLICE_BITS}, as submit's)")
    a.add_argument("--device", default=None,
                   help="torch device to measure on (default: the device setting, cuda if present, else cpu)")
    a.add_argument("--probe-seconds", type=_arg(_within(1, 3600, float)), default=60.0, metavar="S",
                   help="time limit of the scaling probe (default 60)")


def _arg(parse: Any) -> Any:
    """A parser as an argparse type: its ValueError's words, exit status 2 (a usage error)."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = parse.__name__
    return convert


def _within(lo: float, hi: float, kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"not a {'whole ' if kind is int else ''}number: {text!r}") from None
        if not lo <= value <= hi:
            raise ValueError(f"must be between {kind(lo):,} and {kind(hi):,}, got {text}")
        return value
    return parse


@dataclass(frozen=True)
class StepFigures:
    step_s: float
    steps_timed: int
    params: int
    fp32_bytes: int
    delta_bytes: int
    reduced_bytes: int  # the reduced model on the wire: values as little compressible as a mean
    precision: str

    def job(self, overlap: bool, chunk: int | None, slice_min: int | None = None, bits: int = 8,
            slice_bits: int = 8) -> _advise.Job:
        """The prediction's job: these figures, with ``chunk`` values a chunk (None: all
        deltas), slicing where slices save ``slice_min`` bytes a peer (None: wherever they
        can) by the pool's rule for deltas of ``bits`` and slices of ``slice_bits``."""
        chunks = 1 if chunk is None else -(-self.params // chunk)
        return _advise.Job(step_s=self.step_s, delta_bytes=self.delta_bytes, overlap=overlap, chunks=chunks,
                           reduced_bytes=self.reduced_bytes, slice_min=slice_min, bits=bits, slice_bits=slice_bits)


def advise(args: argparse.Namespace, settings: Any) -> int:
    _check_task_name(args.task)
    chunk = chunk_of(args.slices, args.no_slices)
    slice_bits = slice_bits_of(chunk, args.slice_bits) or DEFAULT_SLICE_BITS  # sizes the "slices" rows
    home = Path(settings.home)
    link, link_line = resolve_link(args.link, args.rtt, home, settings.proxy or None)
    device = _device(args.device or settings.device)
    task = _load(args.task, home)
    lines = print_flush
    lines(f"ttpeer advise: {task.name}, batch {args.batch_size}, {args.bits}-bit deltas, overlap "
          f"{'on' if args.overlap else 'off'}, measured on {device} ({_load_words()})")
    fig = measure_step(task, args.batch_size, device, args.bits, slice_bits=slice_bits)
    lines(f"step: {fig.step_s * 1000:.3g} ms (AdamW, {fig.precision}, median of {fig.steps_timed} timed after "
          f"warm-up); {fig.params:,} parameters, {_size(fig.fp32_bytes)} fp32; a delta is "
          f"{_size(fig.delta_bytes)} on the wire ({args.bits}-bit, {fig.fp32_bytes / fig.delta_bytes:.1f}x smaller)")
    job = fig.job(args.overlap, chunk, slice_min_of(args.slices, chunk), args.bits, slice_bits)
    lines(_slices_line(job, fig, chunk, slice_bits))
    lines(link_line)
    gain, gain_line = _gain(args, task, device)
    lines(gain_line)
    rows = _advise.predict(job, link, args.peers, gain)
    lines("")
    for line in _advise.table(rows):
        lines(line)
    lines("")
    lines(_advise.verdict(rows, job, link))
    lines(f"(model: sync with all deltas = delta/up + (n-1) deltas/down + {_advise.ROUND_TRIPS} round "
          f"trips + {_advise.ROUND_FIXED_S:g} s for the close; with s slices = delta/up + (n-1) deltas/(s down) + "
          "reduced model/(s up) + (s-1) reduced slices/(s down) + the spot checks + their round trips; "
          "H as --inner-steps auto sizes rounds; gain kept = "
          f"(1 + (g-1) min(1, g/n)^{_advise.NOISE_EXPONENT:g}/(1 + (n-1)H/{_advise.H_HALF:g})) / (1 + "
          f"{_advise.OVERLAP_COST:g} (1 - 1/n) x the share of a round trained before its close lands), calibrated on "
          "scripts/bench/convergence; time = 1/(gain kept x utilization); see docs/advise.md)")
    return 0


def _slices_line(job: _advise.Job, fig: StepFigures, chunk: int | None, slice_bits: int) -> str:
    """What the pool's rounds close from, in words: the chunks, and the reduced model's size."""
    if chunk is None:
        return "slices: off (--no-slices): every round closes from all deltas, n-1 downloaded a round"
    if job.chunks < 2:
        return (f"slices: the model is one chunk of {chunk:,} values, so every round closes from all deltas "
                "(--slices VALUES: a smaller chunk)")
    where = ("" if job.slice_min is None else
             f" where they save each peer {_size(job.slice_min)} a round or more (else all deltas: --slices "
             "slices wherever it can)")
    return (f"slices: {job.chunks} chunks of {chunk:,} values; from 3 peers a round closes from min(n, "
            f"{job.chunks}) slices{where}; the reduced model is {_size(fig.reduced_bytes)} on the wire "
            f"({slice_bits}-bit with no error feedback, measured on values as little compressible as a mean of "
            "many deltas)")


def _load_words() -> str:
    try:
        return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    except OSError:
        return f"{os.cpu_count()} cores"


def print_flush(line: str) -> None:
    print(line, flush=True)


def _check_task_name(task: str) -> None:
    if not task.endswith(".py") and task.partition(":")[0] not in ("mnist1d", "charlm"):
        raise UsageError(f"unknown task {task!r}: use 'mnist1d' (or 'mnist1d:samples=60000'), 'charlm' "
                         "(or 'charlm:n_layer=4,d_model=128,...') or a path to a task file ending in .py")


def _device(setting: str) -> str:
    """The device the daemon's worker would train on for this setting (``_procexec``)."""
    import torch

    if setting == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    return "cuda:0" if setting == "cuda" else setting


def _load(name: str, home: Path) -> Any:
    import platformdirs

    from ttpeer import train
    from ttpeer.daemon import Home

    shared = Path(platformdirs.user_cache_dir("ttpeer", appauthor=False)) / "data"
    data = Home(home).data_dir if home.is_dir() else shared  # the daemon's cache when there is a home
    if name.endswith(".py") and not Path(name).is_file():
        raise UsageError(f"cannot read task file {name}: no such file")
    from ttpeer._api import _home_datasets

    try:  # dataset_path / dataset_samples: what this machine's home holds
        with train.resolving(_home_datasets(home)):
            return train.load_task(name, data, shared_data=shared)
    except train.DatasetMissing as exc:
        raise UsageError(f"the task reads dataset {exc.name!r}, which this machine's ttpeer home does not hold "
                         f"({'some of its pieces' if exc.pieces else 'it is not here'}): run advise on a machine "
                         "that added or fetched it, or pass --home of one") from None


# -- the step ----------------------------------------------------------------------------


def measure_step(task: Any, batch: int, device: str, bits: int, *, slice_bits: int = DEFAULT_SLICE_BITS,
                 budget_s: float = 3.0) -> StepFigures:
    """Time the job's inner step (warm-up first, then chunks of steps, their median) and
    encode the delta the steps made. Raises what training raises (``TrainError``s)."""
    import torch

    from ttpeer import train

    recipe = train.Recipe.of_job({"batch_size": batch, "rounds": 1, "batches": 1}, device)
    trainer = train.InnerTrainer(task, lr=PROBE_LR, weight_decay=PROBE_WEIGHT_DECAY, device=device, recipe=recipe)
    base = train.init_state(task, 0)
    trainer.start(base)
    gen = torch.Generator().manual_seed(0)

    def batches(n: int) -> list[list[int]]:
        return [torch.randint(task.n_train, (batch,), generator=gen).tolist() for _ in range(n)]

    began = time.perf_counter()
    trainer.train_shard(batches(3))  # the first steps build kernels and caches: not timed
    warm = (time.perf_counter() - began) / 3
    chunk = max(1, min(50, int(budget_s / 5 / max(warm, 1e-5))))
    per_step = []
    for _ in range(5):
        work = batches(chunk)
        began = time.perf_counter()
        trainer.train_shard(work)  # ends with a read of the loss: the device has finished
        per_step.append((time.perf_counter() - began) / chunk)
    wire, _residual = train.encode_delta(trainer.delta(base), None, bits=bits)
    params = sum(t.numel() for t in base.params.values())
    return StepFigures(step_s=statistics.median(per_step), steps_timed=5 * chunk, params=params,
                       fp32_bytes=train.fp32_size(base), delta_bytes=len(wire),
                       reduced_bytes=reduced_size(params, bits=slice_bits), precision=recipe.precision)


def reduced_size(values: int, *, bits: int = DEFAULT_SLICE_BITS, sample: int = REDUCED_SAMPLE) -> int:
    """Wire bytes of a reduced model of ``values`` values in ``bits``: ``encode_slice`` of Gaussian
    values (at most ``sample`` of them, scaled up), which zstd cannot squeeze, as it
    hardly squeezes the mean of many deltas: an upper bound for few peers."""
    import torch

    from ttpeer import train

    n = min(values, sample)
    gen = torch.Generator().manual_seed(0)
    data = train.encode_slice(torch.randn(n, generator=gen) * 1e-3, bits=bits)
    return math.ceil(len(data) * values / n)


# -- the link ----------------------------------------------------------------------------


def resolve_link(rate: float | None, rtt: float | None, home: Path,
                 proxy: str | None) -> tuple[_advise.Link, str]:
    """The link to predict with and the line that says where each figure came from: given,
    measured to the pool's relay, or assumed (with the reason nothing was measured)."""
    given = ", ".join(w for w in (f"{_advise.rate_words(rate)} each way" if rate is not None else "",
                                  f"{rtt * 1000:g} ms" if rtt is not None else "") if w)
    if rate is not None and rtt is not None:
        return _advise.Link(rate, rate, rtt), f"link: given, {given}"
    try:
        measured, url = measure_link(home, proxy)
    except _Unmeasured as exc:
        up = rate if rate is not None else _advise.ASSUMED_RATE
        trip = rtt if rtt is not None else _advise.ASSUMED_RTT
        said = [("given " if rate is not None else "assumed ") + _advise.rate_words(up),
                ("given " if rtt is not None else "assumed ") + f"{trip * 1000:g} ms"]
        return _advise.Link(up, up, trip), f"link: {', '.join(said)} (no relay reachable: {exc})"
    link = _advise.Link(rate or measured.up, rate or measured.down, rtt or measured.rtt)
    words = (f"link: measured to the relay {url}: up {_advise.rate_words(measured.up)}, down "
             f"{_advise.rate_words(measured.down)}, {measured.rtt * 1000:.3g} ms round trip")
    if local_url(url) and not given:
        words += ("; that relay is on this machine, so this is its loopback, not the link real machines will "
                  "have: give --link and --rtt for theirs (e.g. --link 20mbit --rtt 50)")
    return link, words + (f"; given, and used instead: {given}" if given else "")


def local_url(url: str) -> bool:
    """Whether ``url``'s host is this machine (a loopback name or address)."""
    import ipaddress
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Unmeasured(Exception):
    """Why the link could not be measured, in words for the 'assumed' line."""


def measure_link(home: Path, proxy: str | None, *, timeout: float = LINK_TIMEOUT) -> tuple[_advise.Link, str]:
    """Rates and round trip to the relay of ``home``'s pool. Raises ``_Unmeasured`` saying
    why not: no home, no pool, the relay unreachable or refusing, too slow."""
    import trio

    from ttpeer.daemon import Home
    from ttpeer.errors import HomeError
    from ttpeer.net import NetError

    h = Home(home)
    if not home.is_dir():
        raise _Unmeasured(f"no home at {home}")
    if not h.enrolled:
        raise _Unmeasured(f"home {home} is in no pool")
    try:
        cfg = h.config()
        key = h.node_key()
    except (HomeError, OSError) as exc:
        raise _Unmeasured(str(exc)) from None

    async def go() -> _advise.Link:
        with trio.fail_after(timeout):
            return await time_relay(cfg, key, proxy)

    try:
        return trio.run(go), cfg.relays[0]
    except trio.TooSlowError:
        raise _Unmeasured(f"the relay {cfg.relays[0]} took over {timeout:g} s") from None
    except NetError as exc:
        raise _Unmeasured(f"{cfg.relays[0]}: {exc}") from None
    except ValueError as exc:  # a malformed URL or proxy in the configuration
        raise _Unmeasured(str(exc)) from None


async def time_relay(cfg: Any, key: Any, proxy: str | None, *, size: int = PROBE_BYTES,
                     clock: Any = time.perf_counter) -> _advise.Link:
    """Log in to the relay with the daemon's client (pinned certificate, this machine's
    key), then: the round trip is the fastest of 5 HEADs of a blob that is not there;
    the rates are a blob of ``size`` random bytes put (after the HEAD that asks whether
    it is there: 2 round trips) and got twice on a kept connection (1 round trip)."""
    from ttpeer.net import RelayClient

    async with RelayClient(cfg.relays[0], cfg.fingerprint, pool=cfg.pool, peer_key=key, proof=cfg.proof,
                           proxy=proxy, timeout=LINK_TIMEOUT) as client:
        trips = []
        for _ in range(5):
            began = clock()
            await client.has_blob(hashlib.sha256(os.urandom(32)).hexdigest())
            trips.append(clock() - began)
        rtt = min(trips)
        data = os.urandom(size)
        began = clock()
        blob = await client.put_blob(data)
        put_s = clock() - began
        await client.get_blob(blob, max_size=size)  # opens the download connection
        began = clock()
        await client.get_blob(blob, max_size=size)
        get_s = clock() - began
    return _advise.Link(up=size / max(put_s - 2 * rtt, put_s / 10), down=size / max(get_s - rtt, get_s / 10),
                        rtt=rtt)


# -- the scaling probe -------------------------------------------------------------------


def _gain(args: argparse.Namespace, task: Any, device: str) -> tuple[Any, str]:
    if args.quick or args.peers == 1:
        why = "--quick skips the probe" if args.quick else "one peer: nothing to probe"
        return _advise.sqrt_gain, f"data-parallel gain: assumed sqrt(k) for k machines ({why})"
    began = time.perf_counter()
    measured, note = probe_gain(task, args.batch_size, args.peers, device, args.probe_seconds)
    took = time.perf_counter() - began
    shown = ", ".join(f"g({k})={g:.2f}" for k, g in sorted(measured.items()))
    line = f"data-parallel gain: measured in {took:.0f} s: {shown or 'nothing'} ({note})"

    probed = probe_ks(args.peers)

    def gain(k: int) -> float:
        if not measured or (k in probed and k not in measured):
            return _advise.sqrt_gain(k)
        return _advise.interpolate(measured, k)
    return gain, line


def probe_ks(peers: int) -> list[int]:
    """The batch multiples the probe trains: each of 2..N up to 4, then powers of two and N."""
    if peers <= 4:
        return list(range(2, peers + 1))
    return sorted({2 ** i for i in range(1, int(math.log2(peers)) + 1)} | {peers})


def probe_gain(task: Any, batch: int, peers: int, device: str, budget_s: float) -> tuple[dict[int, float], str]:
    """g(k) for the multiples of ``probe_ks``, from eval-loss curves at batch B and k*B
    trained side by side, cut before ``budget_s`` runs out (or at 2000 steps). A k whose
    curves share no range of losses is left out (the note says so; its gain is then
    assumed sqrt(k))."""
    from ttpeer import train

    ks = probe_ks(peers)
    runs = {k: train.LossCurve(task, k * batch, lr=PROBE_LR, weight_decay=PROBE_WEIGHT_DECAY, device=device,
                               eval_samples=1024) for k in [1, *ks]}
    began = time.perf_counter()
    for run in runs.values():
        run.evaluate()
        run.advance(FIRST_BLOCK)
        run.evaluate()
    # Blocks grow with the steps done (about three evaluations per doubling: the curves are
    # steep early), each cut to what the time left allows at the cost per step so far
    # (the load, the device, the larger batches, the evaluations: all in it).
    while runs[1].step < MAX_PROBE_STEPS:
        done, spent = runs[1].step, time.perf_counter() - began
        every = min(max(2, done // 4), MAX_PROBE_STEPS - done, int((budget_s - spent) / (spent / done)))
        if every < 2:
            break
        for run in runs.values():
            run.advance(every)
            run.evaluate()
    measured = {}
    for k in ks:
        g = _advise.gain_of(runs[1].points, runs[k].points, k)
        if g is not None:
            measured[k] = g
    missing = [k for k in ks if k not in measured]
    note = (f"{runs[1].step} steps at batch {batch} and at {', '.join(str(k * batch) for k in ks)}, "
            f"steps to the same eval loss, lr {PROBE_LR:g}")
    if missing:
        note += f"; no common loss for k={', '.join(map(str, missing))}: assumed sqrt(k) there"
    return measured, note


_size = _advise.size_words
