"""Command-line commands for running ttpeer as a service: ``service``, ``config``,
``report``, ``status --watch``, and ``join --service``. ``cli.py`` builds the
parser and dispatches here; the settings come from ``ttpeer.config``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ttpeer.config import SYSTEM_FILE, SYSTEM_HOME, Config, ConfigError, config_file, render_file
from ttpeer.errors import UsageError

if TYPE_CHECKING:
    from ttpeer.daemon.control import Message

R = TypeVar("R")


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    svc = sub.add_parser("service", parents=[common], help="install or remove the systemd service")
    actions = svc.add_subparsers(dest="service_command", metavar="ACTION", required=True)
    for name, text in (("install", "write and enable the systemd unit (root: system service; --user: yours)"),
                       ("uninstall", "stop, disable and remove the unit (homes and settings stay)"),
                       ("show", "print the unit 'install' would write")):
        a = actions.add_parser(name, parents=[common], help=text)
        a.add_argument("--user", action="store_true", help="a unit of your own user (systemctl --user)")
        a.add_argument("--unit-dir", type=Path, default=None,
                       help="write the unit here instead of systemd's folder (packaging, tests)")
        if name == "install":
            a.add_argument("--no-enable", action="store_true", help="write the unit; do not enable or start it")

    c = sub.add_parser("config", parents=[common], help="show the settings in effect")
    cs = c.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = cs.add_parser("show", parents=[common], help="every setting, its value and where it came from")
    show.add_argument("--json", action="store_true", help="one JSON object")

    rv = sub.add_parser("revoke", parents=[common],
                        help="remove a machine from the pool and rotate the pool key (admin only)")
    rv.add_argument("peer", help="the peer's name, id, or a unique id prefix (see 'ttpeer status')")

    cn = sub.add_parser("cancel", parents=[common],
                        help="end a job for the whole pool (the job's submitter or the pool admin)")
    cn.add_argument("job", help="job id or a unique prefix (see 'ttpeer status')")

    rep = sub.add_parser("report", parents=[common], help="write an HTML report of a job (plots embedded)")
    rep.add_argument("job", help="job id or a unique prefix")
    rep.add_argument("out", type=Path, help="output file (.html), self-contained")


def ask_daemon(home: Any, request: Message[R], timeout: float = 60.0) -> R:
    """``ask`` the home's daemon (``ttpeer.daemon.control``); when none answers, say why in
    the newcomer's terms: a home that does not exist or is not enrolled needs more than
    'ttpeer up'."""
    from ttpeer.daemon import ask
    from ttpeer.errors import DaemonNotRunning

    try:
        return ask(home.control_socket, request, timeout=timeout)
    except DaemonNotRunning:
        home.config()  # raises HomeError for a missing, unreadable or unenrolled home
        raise


# -- service -----------------------------------------------------------------------------


def service_home(cfg: Config, user: bool, explicit_home: bool) -> Path:
    """The home a service of this kind serves. The system service's is fixed."""
    if user:
        return cfg.home.expanduser().absolute()
    if explicit_home and cfg.home != SYSTEM_HOME:
        raise UsageError(f"the system service's home is {SYSTEM_HOME} (its StateDirectory); "
                         "drop --home, or use --user for a service on another home")
    return SYSTEM_HOME


def _service_files(cfg: Config, user: bool, home: Path) -> tuple[Path, str]:
    if user:
        path = cfg.file if cfg.file != SYSTEM_FILE else config_file(None, {}, is_root=False)
        comment = "ttpeer settings (written by 'ttpeer service install --user'); see 'ttpeer config show'."
        return path, render_file({"home": str(home)}, comment=comment)
    comment = ("ttpeer settings for the system service and for root's ttpeer commands.\n"
               "Keys: home, device, name, log_level, log_format, metrics, proxy, stop_grace, memory_limit;\n"
               "see 'ttpeer config show'. The service always uses home = /var/lib/ttpeer.")
    return SYSTEM_FILE, render_file({"home": str(SYSTEM_HOME)}, comment=comment)


def service(args: argparse.Namespace, cfg: Config) -> int:
    from ttpeer.daemon import Home
    from ttpeer.daemon.service._units import render_unit, uninstall

    user = args.user
    if args.service_command == "uninstall":
        removed = uninstall(user=user, unit_dir=args.unit_dir, disable=args.unit_dir is None)
        if removed is None:
            print("no ttpeer unit is installed" + (" for this user" if user else ""))
        else:
            print(f"removed {removed}; the home and the settings stay (delete them yourself if you want)")
        return 0
    home = service_home(cfg, user, "home" in cfg.settings and cfg.settings["home"].source.startswith("flag"))
    config_path, config_text = _service_files(cfg, user, home)
    if args.service_command == "show":
        print(render_unit(user=user, python=sys.executable, config=config_path, home=home), end="")
        return 0
    enable = not args.no_enable and args.unit_dir is None
    if enable and not Home(home).enrolled:
        raise UsageError(f"the service's home {home} is not enrolled in a pool yet: run "
                         f"'{'' if user else 'sudo '}ttpeer join - --service{' --user' if user else ''}' "
                         f"(or 'ttpeer pool create --home {home} ...' first), or pass --no-enable")
    return _install(user, home, config_path, config_text, enable, args.unit_dir)


def _install(user: bool, home: Path, config_path: Path, config_text: str, enable: bool,
             unit_dir: Path | None) -> int:
    from ttpeer.daemon.service._units import install

    done = install(user=user, home=home, config=config_path, config_text=config_text, enable=enable,
                   unit_dir=unit_dir)
    print(f"wrote {done.unit}" + (f" and {config_path}" if done.config_written else ""))
    ctl = "systemctl --user" if user else "systemctl"
    journal = "journalctl --user -u ttpeer" if user else "journalctl -u ttpeer"
    if done.enabled:
        print(f"enabled and started ttpeer.service; see '{ctl} status ttpeer', '{journal}', "
              f"'{'' if user else 'sudo '}ttpeer status'")
    else:
        print(f"not enabled; start it with '{ctl} daemon-reload && {ctl} enable --now ttpeer'")
    return 0


def join_service(args: argparse.Namespace, cfg: Config, enroll: Any) -> int:
    """``ttpeer join - --service [--user]``: enroll the service's home, install, start."""
    from ttpeer.daemon import Home

    user = args.user
    if not user and os.geteuid() != 0:
        raise UsageError("'join --service' installs a system service and needs root: use sudo, "
                         "or add --user for a service of your own")
    from ttpeer.daemon.service._units import ServiceError

    home = service_home(cfg, user, cfg.settings["home"].source.startswith("flag"))
    enroll(Home(home))
    config_path, config_text = _service_files(cfg, user, home)
    try:
        return _install(user, home, config_path, config_text, True, None)
    except ServiceError as exc:
        raise ServiceError(f"{exc}\n(this machine is enrolled in {home}; once that is fixed, run "
                           f"'{'' if user else 'sudo '}ttpeer service install{' --user' if user else ''}')") from None


# -- config show ----------------------------------------------------------------------------


def config_show(args: argparse.Namespace, cfg: Config) -> int:
    rows = cfg.rows()
    if args.json:
        print(json.dumps({"file": str(cfg.file), "file_found": cfg.file_found,
                          "settings": {k: {"value": v, "source": s} for k, v, _, s in rows}}, indent=2))
        return 0
    print(f"config file: {cfg.file}" + ("" if cfg.file_found else " (not found: defaults, environment, flags)"))
    width = max(len(k) for k, _, _, _ in rows)
    vwidth = max(len(shown) for _, _, shown, _ in rows)
    for key, _, shown, source in rows:
        print(f"  {key:<{width}}  {shown:<{vwidth}}  {source}")
    return 0


# -- report -------------------------------------------------------------------------------


def report(args: argparse.Namespace, home: Any) -> int:
    from ttpeer._report import write_report

    out: Path = args.out
    if out.parent and not out.parent.exists():
        raise UsageError(f"directory {out.parent} does not exist")
    summary = write_report(home, args.job, out)
    print(f"wrote {out}: {summary}")
    return 0


# -- status --watch -------------------------------------------------------------------------


def watch(home: Any, interval: float, frames: int | None) -> int:
    """Redraw the status every ``interval`` seconds until Ctrl-C (or ``frames`` draws)."""
    from rich.console import Console
    from rich.live import Live

    from ttpeer._watch import render
    from ttpeer.errors import DaemonNotRunning, HomeError

    console = Console()
    count = 0

    from ttpeer.daemon import control

    def fetch() -> Any:
        try:
            return ask_daemon(home, control.Status(), timeout=10).status
        except (DaemonNotRunning, HomeError) as exc:
            return exc

    try:
        with Live(render(fetch()), console=console, auto_refresh=False, transient=False) as live:
            while frames is None or count < frames - 1:
                time.sleep(interval)
                count += 1
                live.update(render(fetch()), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0


def check_interval(value: float) -> float:
    if not 0.1 <= value <= 3600:
        raise ConfigError("--interval must be between 0.1 and 3600 seconds")
    return value


# -- revoke ------------------------------------------------------------------------------


def revoke(args: argparse.Namespace, home: Any) -> int:
    """Ask the running admin daemon to revoke a peer. Raises ``TtpeerError``."""
    from ttpeer.daemon import control

    reply = ask_daemon(home, control.Revoke(args.peer), timeout=120)
    if reply.again:
        print(f"{reply.name} ({reply.peer}) was already revoked; the relay was told again")
    else:
        print(f"revoked {reply.name} ({reply.peer}); the pool key is now at epoch {reply.epoch}")
    print(f"revocation record {reply.record}")
    return 0


# -- relays --------------------------------------------------------------------------------


def relays(args: argparse.Namespace, home: Any) -> int:
    """``relay ls | add | rm`` through the running daemon. Raises ``TtpeerError``."""
    from ttpeer.daemon import control

    said = ""
    if args.relay_command == "ls":
        rows = ask_daemon(home, control.RelayList()).relays
    else:
        change = ask_daemon(home, control.RelayAdd(args.url, args.fingerprint) if args.relay_command == "add"
                            else control.RelayRemove(args.url))
        rows, said = change.relays, change.said
    if getattr(args, "json", False):
        print(json.dumps({"relays": rows}, indent=2))
        return 0
    if said:
        print(said)
    for i, r in enumerate(rows, 1):
        state = r["state"] or "not connected"
        if r["error"] and state != "live":
            state += f": {r['error']}"
        print(f"{i}. {r['url']}  {r['fingerprint']}  {state}" + ("  (primary: blobs go here)" if r["primary"] else ""))
    return 0


# -- cancel --------------------------------------------------------------------------------


def cancel(args: argparse.Namespace, home: Any) -> int:
    """Ask the running daemon to cancel a job for the pool. Raises ``TtpeerError``."""
    from ttpeer.daemon import control

    reply = ask_daemon(home, control.Cancel(args.job), timeout=60)
    if reply.again:
        print(f"job {reply.job[:12]} was already cancelled by {reply.by}")
    else:
        print(f"cancelled job {reply.job[:12]}; every peer stops working on it")
    print(f"cancel record {reply.record}")
    return 0
