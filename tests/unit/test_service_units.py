"""The systemd units: what they promise, and that systemd itself accepts them.

``systemd-analyze verify`` loads a unit the way systemd would (directive names
and values, the ExecStart binary) and exits non-zero on any complaint;
``systemd-analyze security --offline`` rates its sandbox. .ci/run installs
systemd so these run in CI; elsewhere they skip with the reason.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ttpeer.cli import main
from ttpeer.daemon.service._units import render_unit

ROOT = Path(__file__).resolve().parents[2]
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (apt-get install systemd)")


def _verify(unit: Path, *, user: bool, runtime: Path) -> subprocess.CompletedProcess[str]:
    cmd = [ANALYZE, *(["--user"] if user else []), "verify", str(unit)]
    env = {"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(runtime), "SYSTEMD_LOG_COLOR": "0"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def _exposure(unit: Path, *, user: bool, runtime: Path) -> str:
    cmd = [ANALYZE, *(["--user"] if user else []), "security", "--offline=yes", "--no-pager", str(unit)]
    env = {"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(runtime), "SYSTEMD_COLORS": "0"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60).stdout
    found = re.search(r"Overall exposure level for \S+: ([\d.]+ \w+)", out)
    assert found, out[-2000:]
    return found.group(1)


def _units(tmp_path: Path) -> dict[str, tuple[Path, bool]]:
    system = tmp_path / "system" / "ttpeer.service"
    user = tmp_path / "user" / "ttpeer.service"
    relay = tmp_path / "relay" / "ttpeer-relay.service"
    for p in (system, user, relay):
        p.parent.mkdir()
    system.write_text(render_unit(user=False, python=sys.executable, config=Path("/etc/ttpeer/ttpeer.toml")))
    user.write_text(render_unit(user=True, python=sys.executable, config=tmp_path / "ttpeer.toml",
                                home=tmp_path / "home"))
    # The shipped relay unit names /opt/ttpeer-relay/venv/bin/ttpeer-relay; point it at the relay
    # installed here, since verify checks that the binary exists. Nothing else changes.
    installed = Path(sys.executable).parent / "ttpeer-relay"
    text = (ROOT / "bootstrap-relay" / "ttpeer-relay.service").read_text()
    relay.write_text(text.replace("/opt/ttpeer-relay/venv/bin/ttpeer-relay", str(installed)))
    return {"system": (system, False), "user": (user, True), "relay": (relay, False)}


def test_the_daemon_units_say_what_the_issue_asks():
    system = render_unit(user=False, python="/usr/bin/python3", config=Path("/etc/ttpeer/ttpeer.toml"))
    user = render_unit(user=True, python="/usr/bin/python3", config=Path("/c/ttpeer.toml"), home=Path("/h/t p"))
    for unit in (system, user):
        for line in ("Type=notify", "NotifyAccess=main", "Restart=on-failure", "NoNewPrivileges=yes",
                     "ProtectSystem=strict", "PrivateTmp=yes", "KillSignal=SIGTERM", "CapabilityBoundingSet=",
                     # exit 3: revoked, or the token was used up by other machines; a restart cannot help
                     "RestartPreventExitStatus=3"):
            assert line in unit.splitlines(), line
        assert re.search(r"^WatchdogSec=\d+", unit, re.M)
        assert "\nPrivateDevices=" not in unit  # it would hide the GPU
    assert "StateDirectory=ttpeer" in system and "DynamicUser=yes" in system
    assert "--home %S/ttpeer" in system and "--config /etc/ttpeer/ttpeer.toml" in system
    assert re.search(r"^ProtectHome=(yes|tmpfs)$", system, re.M)
    assert 'ExecStart=/usr/bin/python3 -m ttpeer up --config /c/ttpeer.toml --home "/h/t p"' in user
    assert "ProtectHome=read-only" in user and "ReadWritePaths=/h/t p" in user
    assert "WantedBy=default.target" in user and "WantedBy=multi-user.target" in system


@pytest.mark.slow
@needs_analyze
def test_every_unit_passes_systemd_analyze_verify(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    results = {}
    for name, (unit, user) in _units(tmp_path).items():
        done = _verify(unit, user=user, runtime=runtime)
        assert done.returncode == 0 and not done.stderr.strip(), f"{name}: {done.stderr}"
        results[name] = _exposure(unit, user=user, runtime=runtime)
    print("systemd-analyze verify: no complaints; exposure:", results)
    for name, level in results.items():
        assert level.split()[1] in ("SAFE", "OK"), (name, level)


@pytest.mark.slow
@needs_analyze
def test_a_broken_unit_fails_verify(tmp_path):
    # the check above can fail: a typo in a directive is reported
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    unit = tmp_path / "ttpeer.service"
    unit.write_text(render_unit(user=False, python=sys.executable, config=Path("/etc/ttpeer/ttpeer.toml"))
                    .replace("ProtectSystem=strict", "ProtectSytem=strict"))
    done = _verify(unit, user=False, runtime=runtime)
    assert "ProtectSytem" in done.stderr


def test_install_and_uninstall_a_user_unit_in_a_folder(tmp_path, capsys):
    units, conf, home = tmp_path / "units", tmp_path / "conf" / "ttpeer.toml", tmp_path / "home"
    args = ["--config", str(conf), "--home", str(home)]
    assert main(["service", "install", "--user", "--unit-dir", str(units), "--no-enable", *args]) == 0
    out = capsys.readouterr().out
    unit = units / "ttpeer.service"
    assert f"wrote {unit} and {conf}" in out and "not enabled" in out
    text = unit.read_text()
    assert f"--config {conf} --home {home}" in text and "Type=notify" in text
    assert f'home = "{home}"' in conf.read_text()
    assert main(["service", "uninstall", "--user", "--unit-dir", str(units)]) == 0
    assert not unit.exists() and conf.exists()  # settings stay
    assert "removed" in capsys.readouterr().out


def test_service_show_prints_the_system_unit(capsys):
    assert main(["service", "show"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# ttpeer daemon (system service)") and "StateDirectory=ttpeer" in text


def test_the_system_service_keeps_its_own_home(tmp_path, capsys):
    assert main(["service", "show", "--home", str(tmp_path)]) == 1
    assert "the system service's home is /var/lib/ttpeer" in capsys.readouterr().err
