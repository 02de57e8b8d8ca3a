"""The ``ttpeer`` command line. Every command takes ``--home`` (or ``TTPEER_HOME``)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ttpeer.errors import JobError, TtpeerError, UsageError

EPILOG = """\
Start here:
  machine A:  ttpeer relay --listen 0.0.0.0:8443 --data ./relay     (prints URL and fingerprint)
  machine A:  ttpeer pool create --relay URL --fingerprint sha256:HEX   (prints a join token)
              ttpeer up
  machine B:  ttpeer join TOKEN
  any member: ttpeer submit --task mnist1d --mode fused --rounds 10 --inner-steps 25
              ttpeer wait JOB && ttpeer export JOB model.safetensors
              ttpeer submit --task mnist1d --mode ensemble --members 4 --rounds 6 --inner-steps 300
              ttpeer predict model.safetensors inputs.npy
Or try everything on this machine: ttpeer demo
"""


def _duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 90s, 30m, 24h, 7d)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    # SUPPRESS: a subcommand's copy of these options must not reset what was given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--home", type=Path, default=argparse.SUPPRESS,
                        help="ttpeer home directory (default: from the config file, $TTPEER_HOME or the "
                        "per-user data directory)")
    common.add_argument("--config", type=Path, default=argparse.SUPPRESS,
                        help="settings file (default: $TTPEER_CONFIG or ~/.config/ttpeer/ttpeer.toml; "
                        "see 'ttpeer config show')")
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="more log output (repeatable)")
    common.add_argument("--log-format", choices=["text", "json"], default=argparse.SUPPRESS,
                        help="log lines as text (default) or JSON objects")

    p = argparse.ArgumentParser(
        prog="ttpeer", description="Pool your own machines into one training run.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, parents=[common],
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    r = sub.add_parser("relay", parents=[common], help="run the HTTPS rendezvous relay")
    r.add_argument("--listen", default="127.0.0.1:8443", help="HOST:PORT to listen on (port 0: any free port)")
    r.add_argument("--data", type=Path, required=True, help="directory for the certificate, blobs and rosters")
    r.add_argument("--cert", type=Path, help="TLS certificate (PEM); default: self-signed, made on first start")
    r.add_argument("--key", type=Path, help="TLS private key (PEM) for --cert")

    pool = sub.add_parser("pool", parents=[common], help="create a pool").add_subparsers(
        dest="pool_command", metavar="ACTION", required=True)
    pc = pool.add_parser("create", parents=[common], help="create a pool; this machine becomes its admin")
    pc.add_argument("--relay", required=True, help="relay URL, e.g. https://203.0.113.5:8443")
    pc.add_argument("--fingerprint", required=True, help="the relay's certificate fingerprint (sha256:HEX)")
    pc.add_argument("--name", default=None, help="this machine's name in the pool (default: hostname)")
    pc.add_argument("--ttl", type=_duration, default=86400.0, help="lifetime of the printed token (default 24h)")
    pc.add_argument("--uses", type=_positive_int, default=1, help="machines the printed token can enroll")

    inv = sub.add_parser("invite", parents=[common], help="print a new join token (admin only)")
    inv.add_argument("--ttl", type=_duration, default=86400.0, help="token lifetime (default 24h)")
    inv.add_argument("--uses", type=_positive_int, default=1, help="how many machines it can enroll (default 1)")

    j = sub.add_parser("join", parents=[common], help="enroll this machine with a token and run the daemon")
    j.add_argument("token", help="the join token (ttp1....); a secret: it is never logged")
    j.add_argument("--name", default=None, help="this machine's name in the pool (default: hostname)")
    j.add_argument("--device", default=None, help="torch device to train on (default: cuda if present, else cpu)")
    j.add_argument("--workers", default=None, help=_WORKERS_HELP)
    j.add_argument("--slowdown", type=float, default=0.0, help=argparse.SUPPRESS)  # benchmarks and tests
    j.add_argument("--service", action="store_true",
                   help="enroll the service's home, then install and start the systemd service (see 'service')")
    j.add_argument("--user", action="store_true", help="with --service: a service of your own user")
    j.add_argument("--metrics", default=None, help="serve Prometheus metrics on HOST:PORT (loopback only)")

    up = sub.add_parser("up", parents=[common], help="run the daemon of an enrolled home in the foreground")
    up.add_argument("--device", default=None, help="torch device to train on (default: cuda if present, else cpu)")
    up.add_argument("--workers", default=None, help=_WORKERS_HELP)
    up.add_argument("--slowdown", type=float, default=0.0, help=argparse.SUPPRESS)  # benchmarks and tests
    up.add_argument("--metrics", default=None,
                    help="serve Prometheus metrics on HOST:PORT, loopback only (e.g. 127.0.0.1:9464)")

    s = sub.add_parser("submit", parents=[common], help="submit a training job to the pool")
    s.add_argument("--task", required=True,
                   help="'mnist1d[:samples=N]', 'charlm[:key=int,...]' or a task file path/to/task.py (see README)")
    s.add_argument("--mode", choices=["fused", "ensemble"], default="fused",
                   help="fused: one model, periodic averaging; ensemble: --members diverse models that vote")
    s.add_argument("--members", type=_positive_int, default=None,
                   help="ensemble: how many members (each on the full data, its own seed and lr/weight decay)")
    s.add_argument("--rounds", type=_positive_int, default=10,
                   help="outer rounds (default 10); ensemble: units each member trains")
    s.add_argument("--inner-steps", type=_positive_int, default=25,
                   help="inner AdamW steps per shard (default 25); ensemble: steps per unit")
    s.add_argument("--shards", type=_positive_int, default=None,
                   help="shards per round (default: from the speeds peers publish, 2 per peer at first)")
    s.add_argument("--batch-size", type=_positive_int, default=None, help="default: the task's")
    s.add_argument("--inner-lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    s.add_argument("--weight-decay", type=float, default=0.01)
    s.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov SGD lr (default 0.7)")
    s.add_argument("--outer-momentum", type=float, default=0.9, help="outer Nesterov momentum (default 0.9)")
    s.add_argument("--bits", type=int, choices=[4, 8], default=8, help="delta quantization (default 8)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--lease", type=_duration, default=None,
                   help="a shard's claim expires this long after its last renewal (default: twice the "
                        "slowest peer's shard time, 15s-5m; 30s before any speed is known)")
    s.add_argument("--no-steal", action="store_true",
                   help="idle peers do not run backup copies of stragglers' shards")
    s.add_argument("--overlap", action="store_true",
                   help="fused: train round r+1 while round r's deltas travel, starting from this peer's "
                        "own estimate of round r's result (slow links cost little compute; see README)")
    s.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                   help="autocast of forward/backward (weights, optimizer, deltas stay fp32); default: each "
                        "peer picks, bf16 on a GPU that has it, fp32 elsewhere (CPU bf16 is slower)")
    s.add_argument("--micro-batch", type=_positive_int, default=None,
                   help="samples per forward/backward pass, gradients accumulated over the batch (default: "
                        "each peer picks the largest its memory holds)")
    s.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing, for models with gradient_checkpointing_enable()")
    s.add_argument("--lr-schedule", choices=["constant", "cosine", "linear"], default=None,
                   help="inner lr over the job's global inner steps (rounds x inner steps; default constant)")
    s.add_argument("--warmup", type=int, default=None,
                   help="inner steps of linear lr warm-up at the job's start (default 0)")
    s.add_argument("--final-lr-ratio", type=float, default=None,
                   help="cosine/linear: the last step's lr as a fraction of --inner-lr (default 0)")
    s.add_argument("--init", default=None, metavar="FILE|JOB",
                   help="warm start: a .safetensors state dict of the task's model, or a finished job's "
                        "id (its final model on this peer)")

    st = sub.add_parser("status", parents=[common], help="peers, jobs, progress")
    st.add_argument("--json", action="store_true", help="one JSON object (schema in the README)")
    st.add_argument("--watch", action="store_true", help="redraw live progress per peer and per round (Ctrl-C)")
    st.add_argument("--interval", type=float, default=1.0, help="seconds between redraws (default 1)")
    st.add_argument("--frames", type=_positive_int, default=None, help=argparse.SUPPRESS)  # tests: stop after N

    w = sub.add_parser("wait", parents=[common], help="wait until a job is done")
    w.add_argument("job", help="job id or a unique prefix")
    w.add_argument("--timeout", type=_duration, default=None, help="give up after this long (exit 2)")

    e = sub.add_parser("export", parents=[common], help="write a finished job's model as safetensors")
    e.add_argument("job", help="job id or a unique prefix")
    e.add_argument("out", type=Path, help="output file (.safetensors); a .json sidecar is written beside it")

    pr = sub.add_parser("predict", parents=[common], help="print a model's predictions for an input file")
    pr.add_argument("bundle", type=Path, help="a file 'ttpeer export' wrote (fused model or ensemble bundle)")
    pr.add_argument("input", type=Path, help="inputs, one per row: .npy, or text (comma or whitespace separated)")
    pr.add_argument("--task", default=None, help="the task file, for a job trained from one (built-ins are found)")

    d = sub.add_parser("demo", parents=[common], help="a relay and 3 peers on this machine train mnist1d")
    d.add_argument("--rounds", type=_positive_int, default=8)
    d.add_argument("--keep", action="store_true", help="keep the temporary directory")

    from ttpeer._commands import add_commands

    add_commands(sub, common)
    return p


def _settings(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The settings in effect (``ttpeer.config``): flags over environment over file."""
    from ttpeer import config

    verbose = getattr(args, "verbose", 0)
    flags = {
        "home": getattr(args, "home", None), "device": getattr(args, "device", None),
        "workers": getattr(args, "workers", None),
        "name": getattr(args, "name", None), "log_format": getattr(args, "log_format", None),
        "metrics": getattr(args, "metrics", None),
        "log_level": ["info", "debug"][min(verbose, 2) - 1] if verbose else None,
    }
    return config.load(flags, file=getattr(args, "config", None))


def main(argv: list[str] | None = None) -> int:
    from ttpeer import _logging

    args = build_parser().parse_args(argv)
    try:
        args.settings = _settings(args)
        _logging.setup(args.settings.log_level, args.settings.log_format)
        return int(_dispatch(args) or 0)
    except TtpeerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _home(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from ttpeer.daemon import Home

    return Home(args.settings.home)


def _dispatch(args: argparse.Namespace) -> int | None:
    cmd = args.command
    if cmd == "relay":
        from ttpeer_relay.cli import main as relay_main

        argv = ["--listen", args.listen, "--data", str(args.data)]
        if args.cert or args.key:
            if not (args.cert and args.key):
                raise UsageError("--cert and --key go together")
            argv += ["--cert", str(args.cert), "--key", str(args.key)]
        return relay_main(argv)
    if cmd == "pool":
        return _pool_create(args)
    if cmd == "invite":
        return _invite(args)
    if cmd == "join":
        return _join(args)
    if cmd == "up":
        return _up(args, _home(args))
    if cmd == "submit":
        return _submit(args)
    if cmd == "status":
        return _status(args)
    if cmd == "wait":
        return _wait(args)
    if cmd == "export":
        return _export(args)
    if cmd == "predict":
        from ttpeer._predict import predict

        return predict(args.bundle, args.input, args.task)
    if cmd == "demo":
        from ttpeer.demo import run_demo

        return run_demo(rounds=args.rounds, keep=args.keep)
    from ttpeer import _commands

    if cmd == "service":
        return _commands.service(args, args.settings)
    if cmd == "config":
        return _commands.config_show(args, args.settings)
    if cmd == "report":
        return _commands.report(args, _home(args))
    if cmd == "revoke":
        return _commands.revoke(args, _home(args))
    raise UsageError(f"unknown command {cmd}")


def _default_name() -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", os.uname().nodename)[:64]
    return name or "peer"


def _check_relay(url: str, fingerprint: str, proxy: str | None) -> None:
    """Fetch the relay's certificate (through ``proxy`` when set: the daemon will use
    it too) and compare it with the pin, before anything else."""
    import trio

    from ttpeer.net import RelayFingerprintMismatch, fetch_certificate, fingerprint_of

    der = trio.run(lambda: fetch_certificate(url, proxy=proxy))
    got = fingerprint_of(der)
    if got != fingerprint:
        raise RelayFingerprintMismatch(expected=fingerprint, got=got, url=url)


def _pool_create(args: argparse.Namespace) -> int:
    from ttpeer.daemon import new_invite
    from ttpeer.proto import make_token

    if not re.fullmatch(r"sha256:[0-9a-f]{64}", args.fingerprint):
        raise UsageError("--fingerprint must look like sha256:<64 hex digits> (the relay prints it)")
    if not args.relay.startswith("https://"):
        raise UsageError("--relay must be an https:// URL")
    _check_relay(args.relay, args.fingerprint, args.settings.proxy or None)
    home = _home(args)
    now = time.time()
    cfg = home.create_pool(args.relay, args.fingerprint, args.settings.name or _default_name(), now)
    invite, key = new_invite(home.root_key(), cfg.pool, ttl=args.ttl, uses=args.uses, role="member", now=now)
    print(f"pool {cfg.pool} created in {home.path}; this machine ({cfg.name}) is its admin")
    print("start it with 'ttpeer up'; enroll other machines with this token "
          f"(valid {args.ttl / 3600:g} h, {args.uses} use(s)):")
    print(make_token(cfg.relays, cfg.fingerprint, invite, key.private_bytes_raw()))
    return 0


def _invite(args: argparse.Namespace) -> int:
    from ttpeer.daemon import new_invite
    from ttpeer.proto import make_token

    home = _home(args)
    cfg = home.config()
    invite, key = new_invite(home.root_key(), cfg.pool, ttl=args.ttl, uses=args.uses, role="member",
                             now=time.time())
    print(make_token(cfg.relays, cfg.fingerprint, invite, key.private_bytes_raw()))
    return 0


def _join(args: argparse.Namespace) -> int:
    from ttpeer.proto import parse_token

    token = parse_token(args.token, now=time.time())
    _check_relay(token.relays[0], token.fingerprint, args.settings.proxy or None)  # before any key is made or sent

    def enroll(home) -> None:  # type: ignore[no-untyped-def]
        cfg = home.enroll(token, args.settings.name or _default_name(), time.time())
        print(f"enrolled in pool {cfg.pool} as {cfg.name}; home {home.path}", flush=True)

    if args.service:
        from ttpeer._commands import join_service

        return join_service(args, args.settings, enroll)
    if args.user:
        raise UsageError("--user goes with --service")
    home = _home(args)
    enroll(home)
    return _up(args, home)


def _up(args: argparse.Namespace, home) -> int:  # type: ignore[no-untyped-def]
    import trio

    from ttpeer.daemon import run_daemon
    from ttpeer.daemon._systemd import Notifier

    cfg = args.settings
    device = cfg.device  # "auto" is resolved by the worker processes, which load torch: the daemon does not
    options = {"slowdown": args.slowdown} if getattr(args, "slowdown", 0) else None
    notifier = Notifier.from_environ(os.environ)  # systemd's protocol, not a setting
    workers = None if cfg.workers == "auto" else cfg.workers
    trio.run(lambda: run_daemon(home, device=device, task_options=options, proxy=cfg.proxy or None,
                                metrics=cfg.metrics, stop_grace=cfg.stop_grace, notifier=notifier,
                                memory_limit=cfg.memory_limit or None, workers=workers))
    return 0


_WORKERS_HELP = ("worker processes that train each job's shards together, one per local device, "
                 "data-parallel inside this machine (default auto: one per visible CUDA device, 1 on CPU)")


def _submit(args: argparse.Namespace) -> int:
    from ttpeer.daemon import call

    home = _home(args)
    task_file = None
    task = args.task
    if task.endswith(".py"):
        path = Path(task)
        try:
            task_file = path.read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read task file {path}: {exc.strerror}") from None
        task = path.name
    elif task.partition(":")[0] not in ("mnist1d", "charlm"):
        raise UsageError(f"unknown task {task!r}: use 'mnist1d' (or 'mnist1d:samples=60000'), 'charlm' "
                         "(or 'charlm:n_layer=4,d_model=128,...') or a path to a task file ending in .py")
    spec: dict[str, Any] = {
        "task": task, "mode": args.mode, "rounds": args.rounds, "shards": args.shards,
        "batches": args.inner_steps, "batch_size": args.batch_size or 64, "inner_lr": args.inner_lr,
        "weight_decay": args.weight_decay, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
        "bits": args.bits, "seed": args.seed, "lease": args.lease, "steal": not args.no_steal,
    }
    if args.mode == "ensemble" or args.members is not None:
        if args.mode != "ensemble":
            raise UsageError("--members goes with --mode ensemble")
        if args.members is None:
            raise UsageError("--mode ensemble needs --members M (how many models to train)")
        if args.shards is not None:
            raise UsageError("an ensemble job has one shard per member: leave --shards out")
        spec["members"] = args.members
    if args.overlap:
        if args.mode != "fused":
            raise UsageError("--overlap is for fused jobs")
        spec["overlap"] = 1
    spec.update(_recipe_fields(args, home))
    reply = call(home.control_socket, {"op": "submit", "spec": spec,
                                       "task_file": task_file.hex() if task_file else None}, timeout=300)
    if args.mode == "ensemble":
        print(f"submitted ensemble job: {args.members} members x {args.rounds} units x {args.inner_steps} steps, "
              f"lease {reply.get('lease')} s")
    else:
        print(f"submitted {args.mode} job: {args.rounds} rounds x {reply.get('shards')} shards x "
              f"{args.inner_steps} steps, lease {reply.get('lease')} s")
    print(reply["job"])
    return 0


def _recipe_fields(args: argparse.Namespace, home: Any) -> dict[str, Any]:
    """The job fields of the precision, micro-batch, schedule and warm-start flags; only
    those given, so a job without them is the record it always was."""
    fields = {"precision": args.precision, "micro_batch": args.micro_batch, "lr_schedule": args.lr_schedule,
              "warmup": args.warmup, "final_lr_ratio": args.final_lr_ratio,
              "checkpointing": 1 if args.checkpointing else None}
    out = {k: v for k, v in fields.items() if v is not None}
    if args.micro_batch is not None and args.micro_batch > (args.batch_size or 64):
        raise UsageError(f"--micro-batch ({args.micro_batch}) must not exceed the batch size "
                         f"({args.batch_size or 64}): it is how many of the batch's samples one pass takes")
    if args.init is not None:
        # The daemon reads the file (it runs on this machine): ``init`` names it until the
        # daemon replaces it with the initial state's hash.
        path = Path(args.init)
        if not path.is_file() and not args.init.endswith(".safetensors"):
            if not re.fullmatch(r"[0-9a-fA-F]{4,64}", args.init):
                raise UsageError(f"--init {args.init}: no such file, and not a job id; give a .safetensors "
                                 "file or a finished job's id (see 'ttpeer status')")
            path = _finished_job(home, args.init) / "final.safetensors"
        out["init"] = str(path.absolute())
    return out


def _status_obj(home) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    from ttpeer.daemon import call

    return call(home.control_socket, {"op": "status"})["status"]


def _status(args: argparse.Namespace) -> int:
    if args.watch:
        from ttpeer._commands import check_interval, watch

        return watch(_home(args), check_interval(args.interval), args.frames)
    st = _status_obj(_home(args))
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    node = st["node"]
    relay = "connected" if st["relay"]["connected"] else f"NOT connected ({st['relay']['last_error']})"
    print(f"node {node['name']} ({node['id'][:12]}) pool {node['pool'][:12]}  relay {relay}")
    print(f"bytes sent {_size(st['bytes_sent'])}, received {_size(st['bytes_received'])}"
          + (f"; metrics at {st['metrics_url']}" if st.get("metrics_url") else ""))
    for repair in st.get("startup_repairs") or []:
        print(f"repaired at start-up: {repair}")
    print("peers:")
    for peer in st["peers"]:
        seen = "this machine" if peer["self"] else (
            "never heard from" if peer["last_seen_s"] is None else f"heard {peer['last_seen_s']:.0f}s ago")
        print(f"  {peer['name']:<16} {peer['id'][:12]}  {peer['role']:<6}  {seen}")
    print("jobs:" if st["jobs"] else "jobs: none")
    for job in st["jobs"]:
        metric = "" if job["eval_loss"] is None else (
            f"  eval loss {job['eval_loss']:.4f} {job['metric_name']} {job['eval_metric']:.4f}")
        ratio = "" if job["compression_ratio"] is None else f"  compression {job['compression_ratio']:.1f}x"
        use = "" if job.get("utilization") is None else f"  utilization {100 * job['utilization']:.0f}%"
        unit, parts = ("unit", "members") if job["mode"] == "ensemble" else ("round", "shards")
        print(f"  {job['id'][:12]} {job['task']} {job['mode']} {job['state']}: {unit} {job['round']}/"
              f"{job['rounds']}, {parts} {job['shards_done']}/{job['shards_total']}{metric}{ratio}{use}")
        how = [f"{p['name']} {p['precision']} micro-batch {p['micro_batch']}" for p in job.get("peers") or []
               if p.get("precision")]
        if how:
            print(f"    training: {', '.join(how)}")
        for decline in job.get("declines") or []:
            who = "here" if decline["peer"] == node["id"] else f"by {decline['name']} ({decline['peer'][:12]})"
            print(f"    declined {who}: {decline['reason']}")
        if job["declined"] and not any(d["peer"] == node["id"] for d in job.get("declines") or []):
            print(f"    declined here: {job['declined']}")
        for w in (x for x in st.get("workers") or [] if x["job"] == job["id"]):
            restarts = f", restarted {w['deaths']}x" if w["deaths"] else ""
            print(f"    worker {w['rank']}: pid {w['pid']} on {w['device']}{restarts}")
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _find_job(jobs: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    found = [j for j in jobs if j["id"].startswith(prefix.lower())]
    if not found:
        raise JobError(f"no job {prefix!r} is known to this peer (see 'ttpeer status')")
    if len(found) > 1:
        raise UsageError(f"job prefix {prefix!r} is ambiguous; give more characters")
    return found[0]


def _wait(args: argparse.Namespace) -> int:
    home = _home(args)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    delay = 0.2
    while True:
        job = _find_job(_status_obj(home)["jobs"], args.job)
        if job["state"] == "done":
            print(f"job {job['id'][:12]} done: {job['rounds']} rounds, {job['metric_name']} "
                  f"{job['eval_metric']}")
            return 0
        if job["state"] == "declined":
            raise JobError(f"job {job['id'][:12]} was declined by this peer: {job['declined']}")
        if deadline is not None and time.monotonic() >= deadline:
            print(f"error: timed out waiting for job {job['id'][:12]} (round {job['round']}/{job['rounds']})",
                  file=sys.stderr)
            return 2
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)


def _finished_job(home: Any, prefix: str, needs: str = "--init") -> Path:
    """The folder of the finished job ``prefix`` names in ``home``. Raises UsageError
    or JobError (for ``needs``: what asked, in the message)."""
    states = home.path / "states"
    matches = [p for p in states.glob(f"{prefix.lower()}*")] if states.exists() else []
    if len(matches) > 1:
        raise UsageError(f"job prefix {prefix!r} is ambiguous; give more characters")
    # done.json is written last, after the model and its sidecar: until then the job is
    # still finishing here (status says so) and the files may be half there.
    if not matches or not (matches[0] / "done.json").exists():
        raise JobError(f"job {prefix!r} has not finished on this peer (see 'ttpeer status'); "
                       f"{needs} needs its final model")
    return matches[0]


def _export(args: argparse.Namespace) -> int:
    folder = _finished_job(_home(args), args.job, "export")
    out: Path = args.out
    if out.parent and not out.parent.exists():
        raise UsageError(f"directory {out.parent} does not exist")
    shutil.copyfile(folder / "final.safetensors", out)
    shutil.copyfile(folder / "final.json", out.with_suffix(".json"))
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    print(f"wrote {out} and {out.with_suffix('.json')}")
    print(digest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
