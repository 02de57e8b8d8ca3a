"""systemd units for the daemon: render, install, uninstall.

Two flavours:

- **system** (``ttpeer service install``, as root): ``/etc/systemd/system/ttpeer.service``
  runs ``ttpeer up`` as a transient user (``DynamicUser=``) with its home in
  ``StateDirectory=ttpeer`` (``/var/lib/ttpeer``) and its settings in
  ``/etc/ttpeer/ttpeer.toml``.
- **user** (``--user``): ``~/.config/systemd/user/ttpeer.service`` runs as you, on
  your configured home (``ReadWritePaths=`` it, the rest of your home read-only).

Both are ``Type=notify`` (READY, WATCHDOG, STOPPING: see ``_systemd``),
``Restart=on-failure`` (but not after exit 3: revoked, or the token was used up by
other machines), and hardened as far as a GPU training job allows: no new
privileges, a read-only system, private /tmp, no capabilities, no realtime, no
kernel tunables/modules/logs, native syscalls only. Left open on purpose:
``PrivateDevices=`` (it would hide /dev/nvidia* and /dev/dri), and
``MemoryDenyWriteExecute=`` (CUDA and torch's compilers map executable memory).
The daemon runs at a lower CPU and I/O priority and is the kernel's first choice
when memory runs out: the machine stays its owner's, and a killed daemon resumes.

Errors: ``ServiceError`` when not root for a system unit, when the unit cannot be
written, or when ``systemctl`` fails (the message carries its output).
"""

from __future__ import annotations

import grp
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ttpeer.errors import MembershipEnded, TtpeerError

from .._files import write_atomic

UNIT_NAME = "ttpeer.service"
SYSTEM_UNIT_DIR = Path("/etc/systemd/system")
GPU_GROUPS = ("video", "render")  # /dev/dri and /dev/kfd (AMD); NVIDIA's nodes are world-usable
_HOME_ROOTS = (Path("/home"), Path("/root"), Path("/run/user"))


class ServiceError(TtpeerError):
    """Installing or removing the systemd unit failed; the message says what to do."""


def _quote(arg: str) -> str:
    """One ExecStart= word: '%' escaped for specifiers, quoted if it has spaces."""
    arg = arg.replace("%", "%%")
    if any(c in arg for c in " \t\"'\\"):
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


def _spec_path(path: Path) -> str:
    return str(path).replace("%", "%%")


def code_paths() -> list[Path]:
    """Where this Python and ttpeer live: the service must be able to read them."""
    import ttpeer

    found = [Path(sys.prefix), Path(sys.base_prefix), Path(os.path.realpath(sys.executable)).parent,
             Path(ttpeer.__file__).resolve().parent.parent]
    out: list[Path] = []
    for p in found:
        if p not in out and not any(p.is_relative_to(q) for q in out):
            out = [q for q in out if not q.is_relative_to(p)] + [p]
    return out


def _in_homes(paths: list[Path]) -> list[Path]:
    return [p for p in paths if any(p.is_relative_to(root) for root in _HOME_ROOTS)]


def existing_groups(names: tuple[str, ...] = GPU_GROUPS) -> list[str]:
    out = []
    for name in names:
        try:
            grp.getgrnam(name)
        except KeyError:
            continue
        out.append(name)
    return out


_HARDENING = """\
# Hardening that a GPU training job can live with.
NoNewPrivileges=yes
ProtectSystem=strict
PrivateTmp=yes
CapabilityBoundingSet=
AmbientCapabilities=
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
SystemCallArchitectures=native
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
# Not set, on purpose: PrivateDevices= would hide the GPU (/dev/nvidia*, /dev/dri, /dev/kfd);
# MemoryDenyWriteExecute= breaks CUDA and torch's kernel compilers; ProcSubset=pid hides
# /proc/driver/nvidia.
# The owner's machine comes first: lower CPU and I/O priority, and the kernel's first pick
# when memory runs out (the daemon resumes from disk after a kill).
Nice=10
IOSchedulingClass=best-effort
IOSchedulingPriority=7
OOMScoreAdjust=500
LimitNOFILE=65536
"""


def render_unit(*, user: bool, python: str, config: Path, home: Path | None = None,
                readable: list[Path] | None = None, groups: list[str] | None = None) -> str:
    """The unit's text. ``home`` is used by the user unit only (the system unit's home
    is its StateDirectory); ``readable`` lists code paths that must stay visible;
    ``groups`` are supplementary groups that exist on this machine."""
    readable = code_paths() if readable is None else readable
    exec_start = " ".join(_quote(a) for a in [python, "-m", "ttpeer", "up", "--config", str(config)])
    lines = [
        f"# ttpeer daemon ({'user' if user else 'system'} service), written by 'ttpeer service install"
        f"{' --user' if user else ''}'.",
        "# Remove it with 'ttpeer service uninstall'. Settings: " + str(config),
        "",
        "[Unit]",
        "Description=ttpeer peer-to-peer training daemon",
        "After=network-online.target",
        "Wants=network-online.target",
        "StartLimitIntervalSec=600",
        "StartLimitBurst=10",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
    ]
    if user:
        if home is None:
            raise ServiceError("a user unit needs the home directory it serves")
        lines += [
            f"ExecStart={exec_start} --home {_quote(str(home))}",
            "ProtectHome=read-only",
            f"ReadWritePaths={_spec_path(home)}",
        ]
    else:
        hidden = _in_homes(readable)
        lines += [
            f"ExecStart={exec_start} --home %S/ttpeer",
            "DynamicUser=yes",
            "StateDirectory=ttpeer",
            "StateDirectoryMode=0700",
            "ConfigurationDirectory=ttpeer",
        ]
        if hidden:
            lines += ["# ttpeer is installed under a home directory: show only that part of it.",
                      "ProtectHome=tmpfs",
                      "BindReadOnlyPaths=" + " ".join(_spec_path(p) for p in hidden)]
        else:
            lines.append("ProtectHome=yes")
        if groups:
            lines.append("SupplementaryGroups=" + " ".join(groups))
    lines += [
        "# Caches (CUDA's kernel cache, torch's) go where the sandbox lets them be written.",
        "CacheDirectory=ttpeer",
        "Environment=XDG_CACHE_HOME=%C/ttpeer CUDA_CACHE_PATH=%C/ttpeer/nv",
        "UMask=0077",
        "Environment=PYTHONUNBUFFERED=1",
        "Restart=on-failure",
        "RestartSec=10",
        "# Exit 3: revoked, or the token was used up by other machines. Restarting cannot help.",
        f"RestartPreventExitStatus={MembershipEnded.exit_code}",
        "WatchdogSec=120",
        "TimeoutStartSec=180",
        "# SIGTERM: the daemon hands back its claim, lets the write in progress finish, exits 0.",
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        "TimeoutStopSec=90",
        _HARDENING.rstrip("\n"),
        "",
        "[Install]",
        f"WantedBy={'default.target' if user else 'multi-user.target'}",
    ]
    return "\n".join(lines) + "\n"


def user_unit_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_config_dir("systemd", appauthor=False)) / "user"


@dataclass(frozen=True)
class Installed:
    unit: Path
    enabled: bool
    config_written: bool


def _systemctl(user: bool, *args: str) -> None:
    exe = shutil.which("systemctl")
    if exe is None:
        raise ServiceError("systemctl is not on this machine: is it running systemd? The unit is written; "
                           "start 'ttpeer up' another way")
    cmd = [exe, *(["--user"] if user else []), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise ServiceError(f"'systemctl {' '.join(cmd[1:])}' failed ({result.returncode}): "
                           f"{(result.stderr or result.stdout).strip()[-500:]}")


def install(*, user: bool, home: Path, config: Path, config_text: str | None, enable: bool,
            unit_dir: Path | None = None, python: str | None = None) -> Installed:
    """Write the unit (and ``config`` when it does not exist yet, from ``config_text``),
    then ``daemon-reload`` and ``enable --now`` it unless ``enable`` is False.
    Raises ``ServiceError``."""
    if not user and unit_dir is None and os.geteuid() != 0:
        raise ServiceError("a system service needs root: run 'sudo ttpeer service install', "
                           "or 'ttpeer service install --user' for a service of your own")
    folder = unit_dir or (user_unit_dir() if user else SYSTEM_UNIT_DIR)
    text = render_unit(user=user, python=python or sys.executable, config=config, home=home,
                       groups=None if user else existing_groups())
    written = False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if config_text is not None and not config.exists():
            config.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(config, config_text.encode(), 0o644)
            written = True
        write_atomic(folder / UNIT_NAME, text.encode(), 0o644)
    except (OSError, TtpeerError) as exc:
        raise ServiceError(f"could not write the unit in {folder}: {exc}") from None
    if enable:
        _systemctl(user, "daemon-reload")
        _systemctl(user, "enable", "--now", UNIT_NAME)
    return Installed(folder / UNIT_NAME, enable, written)


def uninstall(*, user: bool, unit_dir: Path | None = None, disable: bool = True) -> Path | None:
    """Stop and disable the unit, remove its file, reload systemd. Returns the removed
    path (None if there was none). Homes and settings stay. Raises ``ServiceError``."""
    if not user and unit_dir is None and os.geteuid() != 0:
        raise ServiceError("removing the system service needs root: run 'sudo ttpeer service uninstall'")
    path = (unit_dir or (user_unit_dir() if user else SYSTEM_UNIT_DIR)) / UNIT_NAME
    if not path.exists():
        return None
    if disable:
        _systemctl(user, "disable", "--now", UNIT_NAME)
    try:
        path.unlink()
    except OSError as exc:
        raise ServiceError(f"could not remove {path}: {exc.strerror}") from None
    if disable:
        _systemctl(user, "daemon-reload")
    return path
