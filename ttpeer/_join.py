"""``ttpeer join``: where the token comes from, and keeping it out of ``ps``.

A join token is a secret (it enrolls a machine), and a process's command line is
readable by every local user (``/proc/PID/cmdline``). So the safe forms keep it out
of argv altogether: ``ttpeer join -`` (stdin; a hidden prompt on a terminal),
``--token-file FILE`` or ``TTPEER_TOKEN``. ``ttpeer join TOKEN`` still works, and
after enrolling, every form replaces the process with ``ttpeer up`` (``os.execve``):
the daemon that runs for weeks never holds the token in its argv nor in its
environment (``/proc/PID/environ`` keeps the environment a process started with).
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from pathlib import Path
from typing import NoReturn

from ttpeer.errors import UsageError

ENV_TOKEN = "TTPEER_TOKEN"
_HOW = "pass it on stdin ('ttpeer join -'), with --token-file FILE, or in $TTPEER_TOKEN"


def read_token(args: argparse.Namespace, environ: dict[str, str] | os._Environ[str]) -> str:
    """The token from exactly one source. Raises ``UsageError``; never echoes the token."""
    sources = [name for name, given in (("the command line", args.token is not None),
                                        ("--token-file", args.token_file is not None)) if given]
    if len(sources) > 1:
        raise UsageError("give the token once: as an argument or with --token-file, not both")
    if args.token == "-":
        token = _from_stdin()
    elif args.token is not None:
        token = args.token
    elif args.token_file is not None:
        token = _from_file(args.token_file)
    elif environ.get(ENV_TOKEN):
        token = environ[ENV_TOKEN]
    else:
        raise UsageError(f"join needs the token 'pool create' or 'invite' printed: {_HOW}")
    token = token.strip()
    if not token:
        raise UsageError(f"the token is empty: {_HOW}")
    return token


def _from_stdin() -> str:
    if sys.stdin is None:
        raise UsageError(f"'join -' reads the token from stdin, and there is none: {_HOW}")
    if sys.stdin.isatty():
        return getpass.getpass("join token (not shown): ")
    return sys.stdin.readline()


def _from_file(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise UsageError(f"token file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read token file {path}: {getattr(exc, 'strerror', None) or exc}") from None


def up_argv(args: argparse.Namespace, home: Path) -> list[str]:
    """The ``ttpeer up`` command line that continues this ``join``: the same flags, no token."""
    # -P: not the current directory first on sys.path (a folder named ttpeer there would
    # win); become_daemon puts this ttpeer's own folder first instead.
    argv = [sys.executable, "-P", "-m", "ttpeer", "up", "--home", str(home)]
    if getattr(args, "config", None) is not None:
        argv += ["--config", str(args.config)]
    if getattr(args, "verbose", 0):
        argv.append("-" + "v" * args.verbose)
    if getattr(args, "log_format", None):
        argv += ["--log-format", args.log_format]
    for flag, value in (("--device", args.device), ("--metrics", args.metrics),
                        ("--workers", getattr(args, "workers", None)),
                        ("--direct", getattr(args, "direct", None))):
        if value is not None:
            argv += [flag, value]
    if args.slowdown:
        argv += ["--slowdown", repr(args.slowdown)]
    if getattr(args, "step_s", 0):
        argv += ["--step-s", repr(args.step_s)]
    return argv


def become_daemon(args: argparse.Namespace, home: Path) -> NoReturn:
    """Replace this process with ``ttpeer up`` on the enrolled home (same pid, so a
    supervisor or a shell's job control sees one process), without the token."""
    env = {k: v for k, v in os.environ.items() if k != ENV_TOKEN}
    # The same ttpeer as this process, wherever the daemon is started from.
    here = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, up_argv(args, home), env)
