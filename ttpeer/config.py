"""Configuration: read by this module only, once per command.

Sources, weakest first; each value remembers where it came from
(``ttpeer config show``):

1. built-in defaults;
2. a TOML file: ``--config FILE``, else ``$TTPEER_CONFIG``, else the user config
   directory's ``ttpeer.toml`` (``~/.config/ttpeer/ttpeer.toml``); root, when it
   has no file of its own, reads ``/etc/ttpeer/ttpeer.toml``, the file the system
   service is started with;
3. environment variables (table below);
4. command-line flags.

    key          environment            flag            meaning
    home         TTPEER_HOME            --home          the home directory (keys, records, states)
    device       TTPEER_DEVICE          --device        torch device; "auto": cuda if present, else cpu
    name         TTPEER_NAME            --name          this machine's name in a pool it creates or joins
    log_level    TTPEER_LOG_LEVEL       -v, -vv         warning (default), info, debug
    log_format   TTPEER_LOG_FORMAT      --log-format    text (default) or json (one object a line)
    metrics      TTPEER_METRICS         --metrics       "" (off) or HOST:PORT on loopback for Prometheus
    proxy        HTTPS_PROXY            --proxy         an HTTP CONNECT proxy for the relay
    stop_grace   TTPEER_STOP_GRACE      (none)          seconds to hand claims back on SIGTERM
    memory_limit TTPEER_MEMORY_LIMIT    (none)          most memory a job may use on the device (e.g. 8G);
                                                        0: what the device has free
    workers      TTPEER_WORKERS         --workers       worker processes per job, one per local device;
                                                        "auto": one per visible CUDA device, 1 on CPU
    data_cache   TTPEER_DATA_CACHE      (none)          bytes of fetched datasets kept in the home (e.g. 64G)
    direct       TTPEER_DIRECT          --direct        serve dataset pieces to members directly: auto
                                                        (default), off, PORT, or HOST:PORT to advertise

Errors: ``ConfigError`` (a ``UsageError``) names the file, key or variable that is
wrong and what it should look like. Nothing else in ttpeer reads these variables.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ttpeer.errors import UsageError

SYSTEM_FILE = Path("/etc/ttpeer/ttpeer.toml")
SYSTEM_HOME = Path("/var/lib/ttpeer")
ENV_FILE = "TTPEER_CONFIG"


class ConfigError(UsageError):
    """A configuration file, variable or flag holds something ttpeer cannot use."""


def _text(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("must be a string")
    return v


def _home(v: Any) -> Path:
    text = _text(v)
    if not text:
        raise ValueError("must not be empty")
    return Path(text).expanduser()


def _device(v: Any) -> str:
    text = _text(v)
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?|xpu(:\d+)?", text):
        raise ValueError("must be auto, cpu, cuda, cuda:N, mps or xpu")
    return text


def _workers(v: Any) -> int | str:
    text = _text(v)
    if text == "auto":
        return text
    if not re.fullmatch(r"[0-9]{1,3}", text) or not 1 <= int(text) <= 256:
        raise ValueError("must be auto or a number of worker processes from 1 to 256")
    return int(text)


def _direct(v: Any) -> str:
    text = _text(v).strip()
    direct_mode(text)
    return text.lower() if text.lower() in ("auto", "off") else text


def direct_mode(text: str) -> tuple[str | None, int] | None:
    """``direct`` as configured: None for off, else (the host to advertise, None for the
    relay-facing address; the port, 0 for the last one or any). Raises ``ValueError``."""
    text = text.strip()
    if text.lower() in ("off", "no", "false", ""):
        return None
    if text.lower() == "auto":
        return (None, 0)
    if text.isdigit():
        port = int(text)
        if not 1 <= port <= 65535:
            raise ValueError("a port must be 1-65535")
        return (None, port)
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError("must be auto, off, a PORT, or HOST:PORT (the address others reach this machine at)")
    from ttpeer_wire import host_ok  # the rule the direct record is held to

    if not host_ok(host):
        raise ValueError(f"{host!r} is not a host name or address (an IPv6 address goes in brackets: [::1]:PORT)")
    return (host, int(port_text))


def _name(v: Any) -> str:
    text = _text(v)
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", text):
        raise ValueError("must be 1-64 letters, digits, '.', '_' or '-'")
    return text


def _choice(*options: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        text = _text(v).lower()
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return text

    return check


def _metrics(v: Any) -> str:
    """"" or "off": no endpoint. Else HOST:PORT, and HOST must be a loopback address:
    the endpoint has no authentication, so it never listens beyond this machine."""
    text = _text(v).strip()
    if text.lower() in ("", "off", "no", "false"):
        return ""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("must be HOST:PORT (e.g. 127.0.0.1:9464) or \"\" for off")
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"must listen on loopback (127.0.0.1, ::1 or localhost), not {host!r}: "
                             "the endpoint has no authentication")
    return text


def _proxy(v: Any) -> str:
    text = _text(v).strip()
    if text and not re.match(r"https?://", text):
        raise ValueError("must be an http:// or https:// URL, or \"\"")
    return text


def _grace(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise ValueError("must be a number of seconds")
    value = float(v)
    if not 0 <= value <= 60:
        raise ValueError("must be between 0 and 60 seconds")
    return value


_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def _memory(v: Any) -> int:
    """Bytes: an int, or a number with a K/M/G/T suffix (powers of 1024)."""
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise ValueError("must be a number of bytes, e.g. 8G, 512M or 0 for no limit")
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(v).lower())
    if match is None:
        raise ValueError("must be a number of bytes, e.g. 8G, 512M or 0 for no limit")
    return int(float(match[1]) * _UNITS[match[2]])


@dataclass(frozen=True)
class _Key:
    check: Callable[[Any], Any]
    env: str | None
    flag: str | None
    help: str


def _default_home() -> Path:
    import platformdirs

    return Path(platformdirs.user_data_dir("ttpeer", appauthor=False))


def default_home() -> Path:
    """The home without a flag or a settings file: ``$TTPEER_HOME`` if set, else the
    per-user data directory (``ttpeer.load`` looks for task files there)."""
    env = os.environ.get("TTPEER_HOME")
    return Path(env) if env else _default_home()


KEYS: dict[str, _Key] = {
    "home": _Key(_home, "TTPEER_HOME", "--home", "home directory: keys, record log, model states"),
    "device": _Key(_device, "TTPEER_DEVICE", "--device", "torch device (auto: cuda if present, else cpu)"),
    "name": _Key(_name, "TTPEER_NAME", "--name", "this machine's name in a pool (default: host name)"),
    "log_level": _Key(_choice("error", "warning", "info", "debug"), "TTPEER_LOG_LEVEL", "-v",
                      "log level on stderr"),
    "log_format": _Key(_choice("text", "json"), "TTPEER_LOG_FORMAT", "--log-format", "text or json lines"),
    "metrics": _Key(_metrics, "TTPEER_METRICS", "--metrics", "Prometheus endpoint HOST:PORT on loopback, or off"),
    "proxy": _Key(_proxy, "HTTPS_PROXY", "--proxy", "HTTP CONNECT proxy for the relay"),
    "stop_grace": _Key(_grace, "TTPEER_STOP_GRACE", None, "seconds to hand claims back on SIGTERM"),
    "memory_limit": _Key(_memory, "TTPEER_MEMORY_LIMIT", None,
                         "most memory a job may use on the device, e.g. 8G (0: what it has free)"),
    "workers": _Key(_workers, "TTPEER_WORKERS", "--workers",
                    "worker processes per job, one per device (auto: one per CUDA device, 1 on CPU)"),
    "data_cache": _Key(_memory, "TTPEER_DATA_CACHE", None,
                       "bytes of fetched datasets kept in the home, least recently used evicted first"),
    "direct": _Key(_direct, "TTPEER_DIRECT", "--direct",
                   "serve dataset pieces to members that reach this machine: auto, off, PORT or HOST:PORT"),
}
_ALT_ENV = {"proxy": "https_proxy"}


def _defaults() -> dict[str, Any]:
    return {"home": None, "device": "auto", "name": None, "log_level": "warning", "log_format": "text",
            "metrics": "", "proxy": "", "stop_grace": 5.0,
            "memory_limit": 0, "workers": "auto", "data_cache": 64 * 2**30,
            "direct": "auto"}


@dataclass(frozen=True)
class Setting:
    value: Any
    source: str  # "default", "file PATH", "env NAME" or "flag --x"


@dataclass(frozen=True)
class Config:
    """The settings in effect, each with its source, and the file that was read."""

    settings: dict[str, Setting]
    file: Path
    file_found: bool

    def __getattr__(self, key: str) -> Any:
        try:
            return self.settings[key].value
        except KeyError:
            raise AttributeError(key) from None

    @property
    def home(self) -> Path:
        value = self.settings["home"].value
        return value if value is not None else _default_home()

    def rows(self) -> list[tuple[str, Any, str, str]]:
        """(key, value as JSON would hold it, value as TOML would spell it, source), in table order.
        A proxy's password is hidden."""
        out = []
        for key in KEYS:
            s = self.settings[key]
            value = str(self.home) if key == "home" else s.value
            if key == "proxy" and value:
                value = _hide_password(value)
            shown = "(host name)" if value is None else (json.dumps(value) if isinstance(value, str) else str(value))
            out.append((key, value, shown, s.source))
        return out


def _hide_password(url: str) -> str:
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)


def config_file(flag: Path | None, env: Mapping[str, str], *, is_root: bool | None = None,
                user_dir: Path | None = None, system_file: Path = SYSTEM_FILE) -> Path:
    """Which file to read (it need not exist): the flag, ``$TTPEER_CONFIG``, the user
    file, or for root without a user file the system file."""
    if flag is not None:
        return flag.expanduser()
    if env.get(ENV_FILE):
        return Path(env[ENV_FILE]).expanduser()
    if user_dir is None:
        import platformdirs

        user_dir = Path(platformdirs.user_config_dir("ttpeer", appauthor=False))
    user = user_dir / "ttpeer.toml"
    root = os.geteuid() == 0 if is_root is None else is_root
    if root and not user.exists() and system_file.exists():
        return system_file
    return user


def read_file(path: Path) -> dict[str, Any]:
    """The settings in a TOML file (``{}`` when it does not exist). Raises ``ConfigError``."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown setting {unknown[0]!r} (known: {', '.join(KEYS)})")
    return data


def load(flags: Mapping[str, Any] | None = None, *, file: Path | None = None,
         env: Mapping[str, str] | None = None, **where: Any) -> Config:
    """Resolve every setting. ``flags`` holds only the flags the user gave (others are
    absent or None). ``where`` passes test seams on to ``config_file``. Raises
    ``ConfigError`` for a bad file, variable or flag value."""
    env = os.environ if env is None else env
    path = config_file(file, env, **where)
    settings = {k: Setting(v, "default") for k, v in _defaults().items()}

    def put(key: str, value: Any, source: str) -> None:
        try:
            settings[key] = Setting(KEYS[key].check(value), source)
        except ValueError as exc:
            raise ConfigError(f"{key} from {source}: {exc} (got {value!r})") from None

    from_file = read_file(path)
    for key, value in from_file.items():
        put(key, value, f"file {path}")
    for key, spec in KEYS.items():
        for var in (spec.env, _ALT_ENV.get(key)):
            if var and env.get(var):
                put(key, env[var], f"env {var}")
                break
    for key, value in (flags or {}).items():
        if value is not None:
            put(key, str(value) if isinstance(value, Path) else value, f"flag {KEYS[key].flag}")
    return Config(settings, path, path.exists())


def render_file(values: Mapping[str, Any], *, comment: str = "") -> str:
    """A TOML file with ``values`` (strings and numbers only), for the service installer."""
    lines = [f"# {line}" if line else "#" for line in comment.splitlines()]
    for key, value in values.items():
        if key not in KEYS:
            raise ConfigError(f"unknown setting {key!r}")
        if isinstance(value, str | Path):
            text = str(value).replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'{key} = "{text}"')
        else:
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"
