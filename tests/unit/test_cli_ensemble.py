"""The command line refuses ensemble options that do not go together, and ``predict``
says what is wrong with its input, before anything is sent or loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from ttpeer.cli import main
from ttpeer.daemon.node._admin import by_mode
from ttpeer.errors import UsageError


@pytest.mark.parametrize(("args", "message"), [
    (["--members", "3"], "--members goes with --mode ensemble"),
    (["--mode", "ensemble"], "needs --members"),
    (["--mode", "ensemble", "--members", "3", "--shards", "4"], "one shard per member"),
])
def test_submit_refuses_ensemble_options_that_do_not_fit(tmp_path, capsys, args, message):
    assert main(["submit", "--task", "mnist1d", *args, "--home", str(tmp_path)]) == 1
    assert message in capsys.readouterr().err


def test_the_daemon_lists_members_from_a_count_and_checks_it():
    spec = {"mode": "ensemble", "members": 3, "seed": 7, "inner_lr": 1e-3, "weight_decay": 0.01, "shards": None}
    out = by_mode(spec)
    assert out["shards"] == 3 and len(out["members"]) == 3 and out["members"][0]["seed"] != out["members"][1]["seed"]
    assert "members" not in by_mode({"mode": "fused", "members": None})
    bad_specs = [({**spec, "members": 0}, "between 1 and 4096"), ({**spec, "members": "3"}, "between 1 and 4096"),
                 ({**spec, "shards": 2}, "one shard per member"), ({"mode": "fused", "members": 2}, "goes with"),
                 ({**spec, "init": "/x/m.safetensors"}, "--init warm-starts a fused job"),
                 ({**spec, "mode": "fusion"}, "mode must be one of fused, ensemble")]
    for bad, message in bad_specs:
        with pytest.raises(UsageError, match=message):
            by_mode(bad)


def test_predict_explains_bad_input(tmp_path, capsys):
    bundle = tmp_path / "model.safetensors"
    assert main(["predict", str(bundle), str(tmp_path / "rows.csv")]) == 1
    assert "does not exist" in capsys.readouterr().err
    from ttpeer._predict import read_inputs

    ragged = tmp_path / "ragged.csv"
    ragged.write_text("1,2,3\n4,5\n")
    with pytest.raises(UsageError, match="same number of values"):
        read_inputs(ragged)
    words = tmp_path / "words.txt"
    words.write_text("a b c\n")
    with pytest.raises(UsageError, match="rows of numbers"):
        read_inputs(words)
    with pytest.raises(UsageError, match="does not exist"):
        read_inputs(Path(tmp_path / "nope.npy"))
    assert read_inputs(_write(tmp_path / "one.csv", "1 2 3\n")).shape == (1, 3)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
