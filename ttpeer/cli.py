"""The ``ttpeer`` command line. Every command takes ``--home`` (or ``TTPEER_HOME``)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from ttpeer._parser import Parser, duration, positive_int
from ttpeer._relay_check import check_any_relay, check_typed_relay
from ttpeer._submit_cmd import submit
from ttpeer.errors import TtpeerError, UsageError

EPILOG = """\
Start here:
  machine A:  ttpeer relay --listen 0.0.0.0:8443 --data ./relay     (prints URL and fingerprint)
  machine A:  ttpeer pool create --relay URL --fingerprint sha256:HEX   (prints a join token)
              ttpeer up
  machine B:  ttpeer join -        (paste the token; or --token-file FILE, or $TTPEER_TOKEN)
  any member: ttpeer submit --task mnist1d --rounds 10      (fused; rounds sized to the link)
              ttpeer wait JOB && ttpeer export JOB model.safetensors
              ttpeer submit --task mnist1d --mode ensemble --members 4 --rounds 6 --inner-steps 300
              ttpeer predict model.safetensors inputs.npy
Before a run, ask whether more machines help: ttpeer advise --task mnist1d --peers 3
Or try everything on this machine: ttpeer demo
"""




def build_parser() -> argparse.ArgumentParser:
    # SUPPRESS: a subcommand's copy of these options must not reset what was given before it.
    common = Parser(add_help=False)
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

    p = Parser(
        prog="ttpeer", description="Pool your own machines into one training run.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, parents=[common],
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    r = sub.add_parser("relay", parents=[common], help="run the HTTPS rendezvous relay; or list or change the "
                       "pool's relays (relay ls | add | rm)", description=_RELAY_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       # Running a relay takes no action word, so the usage shows both forms
                       # rather than a positional ACTION that looks required.
                       usage="%(prog)s --data DIR [--listen HOST:PORT] [--cert PEM --key PEM] [options]\n"
                             "       %(prog)s {ls,add,rm} [options] ...")
    r.add_argument("--listen", default="127.0.0.1:8443", help="HOST:PORT to listen on (port 0: any free port)")
    r.add_argument("--data", type=Path, default=None,
                   help="directory for the certificate, blobs and rosters (required to run a relay)")
    r.add_argument("--cert", type=Path, help="TLS certificate (PEM); default: self-signed, made on first start")
    r.add_argument("--key", type=Path, help="TLS private key (PEM) for --cert")
    ra = r.add_subparsers(dest="relay_command", metavar="{ls,add,rm}")
    ra_ls = ra.add_parser("ls", parents=[common], help="the pool's relays, in order, and how this peer sees each")
    ra_ls.add_argument("--json", action="store_true", help="one JSON object")
    ra_add = ra.add_parser("add", parents=[common], help="add a relay to the pool (admin only); every peer uses "
                           "it from then on, and new tokens name it")
    ra_add.add_argument("url", help="the relay's URL, e.g. https://203.0.113.9:8443")
    ra_add.add_argument("--fingerprint", required=True,
                        help="its certificate fingerprint (sha256:HEX), from its 'relay ready URL sha256:...' line")
    ra_rm = ra.add_parser("rm", parents=[common], help="remove a relay from the pool (admin only)")
    ra_rm.add_argument("url", help="the relay's URL, as 'ttpeer relay ls' shows it")

    pool = sub.add_parser("pool", parents=[common], help="create a pool").add_subparsers(
        dest="pool_command", metavar="ACTION", required=True)
    pc = pool.add_parser("create", parents=[common], help="create a pool; this machine becomes its admin")
    pc.add_argument("--relay", required=True, help="relay URL, e.g. https://203.0.113.5:8443")
    pc.add_argument("--fingerprint", required=True, help="the relay's certificate fingerprint (sha256:HEX)")
    pc.add_argument("--name", default=None, help="this machine's name in the pool (default: hostname)")
    pc.add_argument("--ttl", type=duration, default=86400.0, help="lifetime of the printed token (default 24h)")
    pc.add_argument("--uses", type=positive_int, default=1, help="machines the printed token can enroll")

    inv = sub.add_parser("invite", parents=[common], help="print a new join token (admin only)")
    inv.add_argument("--ttl", type=duration, default=86400.0, help="token lifetime (default 24h)")
    inv.add_argument("--uses", type=positive_int, default=1, help="how many machines it can enroll (default 1)")

    j = sub.add_parser("join", parents=[common], help="enroll this machine with a token and run the daemon")
    j.add_argument("token", nargs="?", default=None,
                   help="the join token (ttp1....), or '-' to read it from stdin (safer: an argument is "
                        "visible in 'ps' until enrolled); default: --token-file or $TTPEER_TOKEN")
    j.add_argument("--token-file", type=Path, default=None, help="read the token from this file")
    j.add_argument("--name", default=None, help="this machine's name in the pool (default: hostname)")
    j.add_argument("--device", default=None, help="torch device to train on (default: cuda if present, else cpu)")
    j.add_argument("--workers", default=None, help=_WORKERS_HELP)
    j.add_argument("--slowdown", type=float, default=0.0, help=argparse.SUPPRESS)  # benchmarks and tests
    j.add_argument("--step-s", type=float, default=0.0, help=argparse.SUPPRESS)  # benchmarks: emulated compute
    j.add_argument("--service", action="store_true",
                   help="enroll the service's home, then install and start the systemd service (see 'service')")
    j.add_argument("--user", action="store_true", help="with --service: a service of your own user")
    j.add_argument("--metrics", default=None, help="serve Prometheus metrics on HOST:PORT (loopback only)")
    j.add_argument("--direct", default=None, help=_DIRECT_HELP)

    up = sub.add_parser("up", parents=[common], help="run the daemon of an enrolled home in the foreground")
    up.add_argument("--device", default=None, help="torch device to train on (default: cuda if present, else cpu)")
    up.add_argument("--workers", default=None, help=_WORKERS_HELP)
    up.add_argument("--slowdown", type=float, default=0.0, help=argparse.SUPPRESS)  # benchmarks and tests
    up.add_argument("--step-s", type=float, default=0.0, help=argparse.SUPPRESS)  # benchmarks: emulated compute
    up.add_argument("--metrics", default=None,
                    help="serve Prometheus metrics on HOST:PORT, loopback only (e.g. 127.0.0.1:9464)")
    up.add_argument("--direct", default=None, help=_DIRECT_HELP)

    from ttpeer._submit_cmd import add_parser as add_submit

    add_submit(sub, common)

    pr = sub.add_parser("predict", parents=[common], help="print a model's predictions for an input file")
    pr.add_argument("bundle", type=Path, help="a file 'ttpeer export' wrote (fused model or ensemble bundle)")
    pr.add_argument("input", type=Path, help="inputs, one per row: .npy, or text (comma or whitespace separated)")
    pr.add_argument("--task", default=None,
                    help="the task file, for a job trained from one (default: found by its hash beside "
                         "the model, where export copies it, or in --home)")

    d = sub.add_parser("demo", parents=[common],
                       help="a relay and 4 peers on this machine: a pool of 3 against one peer alone, on paced steps")
    d.add_argument("--rounds", type=positive_int, default=8,
                   help="each job's length: ROUNDS x 80 steps a peer (default 8: about a minute)")
    d.add_argument("--keep", action="store_true", help="keep the temporary directory")

    from ttpeer._advise_cmd import add_parser as add_advise
    from ttpeer._commands import add_commands
    from ttpeer._data_cmds import add_parser as add_data
    from ttpeer._export import add_parser as add_export
    from ttpeer._status_cmds import add_parser as add_status

    add_commands(sub, common)
    add_status(sub, common)
    add_export(sub, common)
    add_advise(sub, common)
    add_data(sub, common)
    return p


def _settings(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The settings in effect (``ttpeer.config``): flags over environment over file."""
    from ttpeer import config

    verbose = getattr(args, "verbose", 0)
    flags = {
        "home": getattr(args, "home", None), "device": getattr(args, "device", None),
        "workers": getattr(args, "workers", None),
        "name": getattr(args, "name", None), "log_format": getattr(args, "log_format", None),
        "metrics": getattr(args, "metrics", None), "direct": getattr(args, "direct", None),
        "log_level": ["info", "debug"][min(verbose, 2) - 1] if verbose else None,
    }
    return config.load(flags, file=getattr(args, "config", None))


def main(argv: list[str] | None = None) -> int:
    from ttpeer import _suggest

    parser = build_parser()
    args = parser.parse_args(argv)
    with _suggest.carrying(args, parser):  # the commands it suggests carry the user's --home
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    from ttpeer import _logging

    try:
        args.settings = _settings(args)
        _logging.setup(args.settings.log_level, args.settings.log_format)
        code = int(_dispatch(args) or 0)
        sys.stdout.flush()  # here, so that a closed pipe is met inside the try
        return code
    except TtpeerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 1))  # MembershipEnded: 3, which systemd does not restart
    except BrokenPipeError:
        # 'ttpeer status | head -1': the reader has gone, as for any Unix tool that is
        # silent, and with SIGPIPE's status. Point stdout at /dev/null so that the
        # interpreter's last flush does not complain.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    except OSError as exc:
        # A file the user named or the home cannot be read or written: say which.
        where = f" {exc.filename}" if exc.filename else ""
        print(f"error: cannot use{where}: {exc.strerror or exc} (check the path and its permissions)",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _home(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from ttpeer.daemon import Home

    return Home(args.settings.home)


def _relay(args: argparse.Namespace) -> int:
    from ttpeer_relay.cli import main as relay_main

    if getattr(args, "relay_command", None):
        from ttpeer import _commands

        if args.relay_command == "add":
            check_typed_relay(args.url, args.fingerprint, args.settings.proxy or None, url_is="the relay's URL",
                               nothing="nothing was changed")
        return _commands.relays(args, _home(args))
    if args.data is None:
        raise UsageError("ttpeer relay needs --data DIR to run a relay (its certificate, blobs and rosters); "
                         "'ttpeer relay ls' lists the pool's relays")
    argv = ["--listen", args.listen, "--data", str(args.data)]
    if args.cert or args.key:
        if not (args.cert and args.key):
            raise UsageError("--cert and --key go together")
        argv += ["--cert", str(args.cert), "--key", str(args.key)]
    return relay_main(argv)


def _client(name: str, args: argparse.Namespace) -> int:
    from ttpeer import _status_cmds

    return int(getattr(_status_cmds, name)(args, _home(args)))


def _predict(args: argparse.Namespace) -> int:
    from ttpeer._predict import predict

    return predict(args.bundle, args.input, args.task, home=args.settings.home)


def _demo(args: argparse.Namespace) -> int:
    from ttpeer.demo import run_demo

    # The demo creates its pool and exports its models with this module's commands,
    # run in this process: handed down, so that the demo does not import the CLI back.
    return run_demo(rounds=args.rounds, keep=args.keep, command=run)


def _advise(args: argparse.Namespace) -> int:
    from ttpeer._advise_cmd import advise

    return advise(args, args.settings)


def _service(args: argparse.Namespace) -> int:
    from ttpeer import _commands

    return _commands.service(args, args.settings)


def _config(args: argparse.Namespace) -> int:
    from ttpeer import _commands

    return _commands.config_show(args, args.settings)


def _report(args: argparse.Namespace) -> int:
    from ttpeer import _commands

    return _commands.report(args, _home(args))


def _revoke(args: argparse.Namespace) -> int:
    from ttpeer import _commands

    return _commands.revoke(args, _home(args))


def _cancel(args: argparse.Namespace) -> int:
    from ttpeer import _commands

    return _commands.cancel(args, _home(args))


def _data(args: argparse.Namespace) -> int:
    from ttpeer import _data_cmds

    return _data_cmds.run(args, _home(args))


def _dispatch(args: argparse.Namespace) -> int | None:
    handler = COMMANDS.get(args.command)
    if handler is None:
        raise UsageError(f"unknown command {args.command}")
    return handler(args)


def run(*args: str) -> list[str]:
    """Run a ttpeer command in this process and return its output lines (the demo's
    and the test harness's way to run one). Raises ``TtpeerError`` if it exits non-zero."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(list(args))
    if code != 0:
        raise TtpeerError(f"'ttpeer {args[0]}' failed ({code}): {buf.getvalue()[-500:]}")
    return buf.getvalue().splitlines()


def _default_name() -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", os.uname().nodename)[:64]
    return name or "peer"


def _pool_create(args: argparse.Namespace) -> int:
    from ttpeer_wire import make_token

    from ttpeer.daemon import new_invite

    check_typed_relay(args.relay, args.fingerprint, args.settings.proxy or None, url_is="--relay",
                       nothing="nothing was created")
    home = _home(args)
    now = time.time()
    cfg = home.create_pool(args.relay, args.fingerprint, args.settings.name or _default_name(), now)
    invite, key = new_invite(home.root_key(), cfg.pool, ttl=args.ttl, uses=args.uses, role="member", now=now)
    print(f"pool {cfg.pool} created in {home.path}; this machine ({cfg.name}) is its admin")
    print("start it with 'ttpeer up'; enroll other machines with this token "
          f"(valid {args.ttl / 3600:g} h, {args.uses} use(s)):")
    print(make_token(cfg.relays, cfg.fingerprint, invite, key.private_bytes_raw(), fingerprints=cfg.fingerprints))
    return 0


def _invite(args: argparse.Namespace) -> int:
    from ttpeer_wire import make_token

    from ttpeer.daemon import new_invite

    home = _home(args)
    cfg = home.config()
    invite, key = new_invite(home.root_key(), cfg.pool, ttl=args.ttl, uses=args.uses, role="member",
                             now=time.time())
    print(make_token(cfg.relays, cfg.fingerprint, invite, key.private_bytes_raw(), fingerprints=cfg.fingerprints))
    return 0


def _join(args: argparse.Namespace) -> int:
    from ttpeer._join import become_daemon, read_token
    from ttpeer.proto import parse_token

    token = parse_token(read_token(args, os.environ), now=time.time())
    _check_extras(args.settings)  # before the token is used up
    check_any_relay(token.relay_pairs(), args.settings.proxy or None)  # before any key is made or sent

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
    become_daemon(args, home.path)  # 'ttpeer up', without the token in argv or environment


def _check_extras(cfg) -> None:  # type: ignore[no-untyped-def]
    """A setting that needs an optional package says so before a daemon starts or a token is used."""
    if cfg.metrics and importlib.util.find_spec("prometheus_client") is None:
        raise UsageError("metrics (--metrics, or 'metrics' in the config) need the prometheus-client package, "
                         "which is not installed here: pip install 'ttpeer[metrics]'")


def _up(args: argparse.Namespace, home) -> int:  # type: ignore[no-untyped-def]
    home.config()  # a missing or unenrolled home says so, before torch is imported
    import trio

    ended = home.ended()
    if ended is not None:  # revoked, or its token went to others: say so before loading torch
        from ttpeer.errors import MembershipEnded

        raise MembershipEnded(ended)
    from ttpeer.daemon import run_daemon
    from ttpeer.daemon.service._systemd import Notifier

    cfg = args.settings
    _check_extras(cfg)
    device = cfg.device  # "auto" is resolved by the worker processes, which load torch: the daemon does not
    options = {name: getattr(args, name) for name in ("slowdown", "step_s") if getattr(args, name, 0)} or None
    notifier = Notifier.from_environ(os.environ)  # systemd's protocol, not a setting
    workers = None if cfg.workers == "auto" else cfg.workers
    try:
        trio.run(lambda: run_daemon(home, device=device, task_options=options, proxy=cfg.proxy or None,
                                    metrics=cfg.metrics, stop_grace=cfg.stop_grace, notifier=notifier,
                                    memory_limit=cfg.memory_limit or None, workers=workers,
                                    data_cache=cfg.data_cache, direct=cfg.direct))
    except TtpeerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        _leave_now(int(getattr(exc, "exit_code", 1)))  # MembershipEnded: 3, which systemd does not restart
    _leave_now(0)


def _leave_now(code: int) -> NoReturn:
    """End the daemon's process without the interpreter's teardown: with torch loaded it
    took 2-5 s on a busy 2-core machine (C destructors, after the last line of Python),
    which made a stop slow for nothing. Everything durable is written by now: states
    by atomic rename, the record log closed by the daemon on its way out."""
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


_RELAY_HELP = """Run the HTTPS rendezvous relay (--data DIR), or list and change the pool's relays.

A pool may have up to 8 relays, each pinned by its own certificate. Every peer sends its
messages through every live relay and its blobs through the first live one, so a relay
that dies loses nothing: the others carry on, and what only the dead one held is sent
again by its uploaders.

  ttpeer relay --listen 0.0.0.0:8443 --data /var/lib/ttpeer-relay   run a relay
  ttpeer relay ls                                                   the pool's relays
  ttpeer relay add https://203.0.113.9:8443 --fingerprint sha256:... (admin)
  ttpeer relay rm https://203.0.113.9:8443                           (admin)
"""

_DIRECT_HELP = ("serve the dataset pieces held here to members that can reach this machine (the same LAN, or a "
                "public address), over TLS pinned in a signed record; peers that cannot still use the relay. "
                "auto (default): the address this machine reaches the relay from; off; PORT; or HOST:PORT to "
                "advertise (a forwarded port)")
_WORKERS_HELP = ("worker processes that train each job's shards together, one per local device, "
                 "data-parallel inside this machine (default auto: one per visible CUDA device, 1 on CPU)")


def _export(args: argparse.Namespace) -> int:
    from ttpeer._export import run

    return run(args, _home(args))


# Each command's handler, by its name in build_parser; each imports what it needs when run,
# so that 'ttpeer status' does not load torch.
COMMANDS: dict[str, Callable[[argparse.Namespace], int | None]] = {
    "relay": _relay, "pool": _pool_create, "invite": _invite, "join": _join,
    "up": lambda args: _up(args, _home(args)), "submit": lambda args: submit(args, _home(args)),
    "status": lambda args: _client("status", args), "wait": lambda args: _client("wait", args),
    "export": _export, "predict": _predict, "demo": _demo, "service": _service, "config": _config,
    "report": _report, "revoke": _revoke, "cancel": _cancel, "advise": _advise, "data": _data,
}


if __name__ == "__main__":
    sys.exit(main())
