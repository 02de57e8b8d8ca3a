"""Configuration: one file, the environment over it, flags over both; every value
says where it came from, and every mistake names its place."""

from __future__ import annotations

import json

import pytest

from ttpeer import _logging, config
from ttpeer.cli import main
from ttpeer.config import ConfigError


def _file(tmp_path, text: str):
    path = tmp_path / "ttpeer.toml"
    path.write_text(text)
    return path


def test_flags_beat_environment_beat_file_beat_defaults(tmp_path):
    path = _file(tmp_path, 'home = "/from/file"\ndevice = "cpu"\nmetrics = "127.0.0.1:9464"\nlog_level = "info"\n')
    env = {"TTPEER_DEVICE": "cuda:1", "TTPEER_LOG_LEVEL": "debug"}
    cfg = config.load({"log_level": "warning", "home": None}, file=path, env=env)
    assert (cfg.home.as_posix(), cfg.settings["home"].source) == ("/from/file", f"file {path}")
    assert (cfg.device, cfg.settings["device"].source) == ("cuda:1", "env TTPEER_DEVICE")
    assert (cfg.log_level, cfg.settings["log_level"].source) == ("warning", "flag -v")
    assert (cfg.metrics, cfg.settings["metrics"].source) == ("127.0.0.1:9464", f"file {path}")
    assert (cfg.log_format, cfg.settings["log_format"].source) == ("text", "default")
    assert cfg.file_found


def test_mistakes_name_the_file_key_or_variable(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown setting 'hoem'.*known: home"):
        config.load(file=_file(tmp_path, 'hoem = "/x"\n'), env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(file=_file(tmp_path, "home = \n"), env={})
    with pytest.raises(ConfigError, match=r"device from env TTPEER_DEVICE: must be"):
        config.load(file=tmp_path / "none.toml", env={"TTPEER_DEVICE": "gpu0"})
    with pytest.raises(ConfigError, match="stop_grace from file"):
        config.load(file=_file(tmp_path, "stop_grace = 600\n"), env={})


def test_metrics_listen_only_on_loopback(tmp_path):
    none = tmp_path / "none.toml"
    for ok in ("127.0.0.1:9464", "[::1]:0", "localhost:9100", "127.0.0.2:1"):
        assert config.load({"metrics": ok}, file=none, env={}).metrics == ok
    assert config.load({"metrics": "off"}, file=none, env={}).metrics == ""
    for bad in ("0.0.0.0:9464", "192.168.1.5:9464", "example.com:80", "9464", "127.0.0.1:99999"):
        with pytest.raises(ConfigError, match="metrics from flag --metrics"):
            config.load({"metrics": bad}, file=none, env={})


def test_which_file_is_read(tmp_path):
    user_dir, system = tmp_path / "user", tmp_path / "etc.toml"
    assert config.config_file(None, {}, is_root=False, user_dir=user_dir) == user_dir / "ttpeer.toml"
    assert config.config_file(None, {"TTPEER_CONFIG": "/x.toml"}, user_dir=user_dir) == config.Path("/x.toml")
    # root with no file of its own reads the service's file, so 'sudo ttpeer status' finds the service
    user = user_dir / "ttpeer.toml"
    assert config.config_file(None, {}, is_root=True, user_dir=user_dir, system_file=system) == user
    system.write_text("")
    assert config.config_file(None, {}, is_root=True, user_dir=user_dir, system_file=system) == system
    assert config.config_file(None, {}, is_root=False, user_dir=user_dir, system_file=system) == user


def test_config_show_prints_values_and_sources(tmp_path, monkeypatch, capsys):
    path = _file(tmp_path, 'device = "cpu"\nproxy = "http://user:hunter2@proxy.test:3128"\n')
    monkeypatch.setenv("TTPEER_CONFIG", str(path))
    monkeypatch.setenv("TTPEER_LOG_FORMAT", "json")
    # a flag given before the command is not reset by the command's own copy of it
    assert main(["--home", str(tmp_path / "h"), "config", "show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    s = shown["settings"]
    assert shown["file"] == str(path) and shown["file_found"]
    assert s["home"] == {"value": str(tmp_path / "h"), "source": "flag --home"}
    assert s["device"]["source"] == f"file {path}"
    assert s["log_format"] == {"value": "json", "source": "env TTPEER_LOG_FORMAT"}
    assert "hunter2" not in s["proxy"]["value"] and "***" in s["proxy"]["value"]
    assert main(["config", "show"]) == 0
    text = capsys.readouterr().out
    assert f"config file: {path}" in text and "env TTPEER_LOG_FORMAT" in text
    _logging.setup()  # main() configured JSON logs for this process: back to the default


def test_a_bad_config_is_a_clear_error_for_every_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TTPEER_CONFIG", str(_file(tmp_path, "metrics = '0.0.0.0:9464'\n")))
    assert main(["status", "--home", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "error: metrics from file" in err and "loopback" in err


def test_data_cache_reads_sizes_and_defaults_to_64_gib(tmp_path):
    assert config.load(file=tmp_path / "none.toml", env={}).data_cache == 64 * 2**30
    assert config.load(file=tmp_path / "none.toml", env={"TTPEER_DATA_CACHE": "2G"}).data_cache == 2 * 2**30
    assert config.load(file=_file(tmp_path, 'data_cache = "500M"\n'), env={}).data_cache == 500 * 2**20


def test_memory_limit_reads_sizes_and_defaults_to_no_limit(tmp_path):
    assert config.load(file=tmp_path / "none.toml", env={}).memory_limit == 0
    env = {"TTPEER_MEMORY_LIMIT": "512M"}
    assert config.load(file=tmp_path / "none.toml", env=env).memory_limit == 512 * 2**20
    assert config.load(file=_file(tmp_path, 'memory_limit = "1.5GiB"\n'), env={}).memory_limit == 3 * 2**29
    assert config.load(file=_file(tmp_path, "memory_limit = 4096\n"), env={}).memory_limit == 4096
    with pytest.raises(ConfigError, match="memory_limit from env TTPEER_MEMORY_LIMIT: must be a number of bytes"):
        config.load(file=tmp_path / "none.toml", env={"TTPEER_MEMORY_LIMIT": "lots"})


def test_without_flag_or_file_the_home_is_ttpeer_home_else_the_per_user_data_dir(tmp_path, monkeypatch):
    # What ttpeer.load falls back on to find a task file (it reads no settings file).
    import platformdirs

    monkeypatch.setenv("TTPEER_HOME", str(tmp_path / "h"))
    assert config.default_home() == tmp_path / "h"
    monkeypatch.delenv("TTPEER_HOME")
    assert config.default_home() == config.load({}, file=_file(tmp_path, "")).home
    assert str(config.default_home()) == platformdirs.user_data_dir("ttpeer", appauthor=False)
