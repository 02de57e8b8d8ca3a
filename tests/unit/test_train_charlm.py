"""The built-in charlm task: its corpus is exactly the stdlib sources it claims, in
a fixed order with a recorded hash; its sizes are checked; it learns; its
perplexity is exp of the validation loss."""

from __future__ import annotations

import hashlib
import math
import sysconfig
from pathlib import Path

import pytest
import torch

from ttpeer.train import InnerTrainer, TaskError, export_model, init_state, load_task, shard_indices
from ttpeer.train._charlm import VAL_SEQUENCES, charlm_task, corpus_files, load_corpus, parse_config
from ttpeer.train._inner import EVAL_BATCH

torch.set_num_threads(1)

TINY = "charlm:block_size=16,d_model=32,n_layer=1,n_head=2"


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def test_corpus_is_the_sources_in_sorted_order_without_tests_and_gui(tmp_path):
    root = _tree(tmp_path / "lib", {
        "b.py": b"B" * 40, "a/z.py": b"Z" * 30, "a/__init__.py": b"I" * 30, "c.txt": b"no",
        "test/t.py": b"T", "idlelib/x.py": b"X", "tkinter/k.py": b"K", "lib2to3/l.py": b"L",
        "site-packages/s.py": b"S", "email/tests/e.py": b"E",
    })
    assert [p.relative_to(root).as_posix() for p in corpus_files(root)] == ["a/__init__.py", "a/z.py", "b.py"]
    corpus, digest = load_corpus(root)
    expected = b"I" * 30 + b"Z" * 30 + b"B" * 40
    assert bytes(corpus.tolist()) == expected
    assert digest == hashlib.sha256(expected).hexdigest()

    spec, source_hash = charlm_task("charlm:block_size=8", root)
    assert spec.info["corpus_sha256"] == digest and spec.info["corpus_bytes"] == "100"
    x, y = spec.train
    assert x.shape == (11, 8) and torch.equal(x.flatten()[1:], y.flatten()[:-1])  # y is x shifted by one
    assert bytes(x[0].tolist()) == b"I" * 8
    assert source_hash != charlm_task("charlm:block_size=4", root)[1]


def test_a_python_without_sources_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match="without its standard library sources"):
        charlm_task("charlm", tmp_path / "empty")


@pytest.mark.parametrize(("spec", "message"), [
    ("charlm:depth=3", "cannot read 'depth=3'"),
    ("charlm:n_layer", "cannot read 'n_layer'"),
    ("charlm:n_layer=two", "n_layer must be an int"),
    ("charlm:d_model=30,n_head=4", "must be a multiple of n_head"),
    ("charlm:block_size=0", "block_size must be an int from 1"),
])
def test_bad_sizes_are_refused_with_what_to_write(spec, message):
    with pytest.raises(TaskError, match=message):
        load_task(spec, Path("/nonexistent"))


def test_stdlib_task_is_deterministic_and_records_its_corpus():
    a = load_task("charlm", Path("/nonexistent"))
    b = load_task("charlm", Path("/nonexistent"))
    assert a.source_hash == b.source_hash and a.name == "charlm" and a.metric_name == "perplexity"
    assert a.spec.info["python"] == sysconfig.get_python_version()
    assert int(a.spec.info["corpus_bytes"]) > 1_000_000  # the whole stdlib, not a sample
    assert a.n_test == VAL_SEQUENCES <= EVAL_BATCH  # one evaluation batch: exact perplexity
    assert parse_config("charlm:n_layer=3").n_layer == 3
    assert load_task(TINY, Path("/nonexistent")).source_hash != a.source_hash


@pytest.mark.slow
def test_it_learns_and_perplexity_is_exp_of_the_validation_loss(tmp_path):
    task = load_task(TINY, Path("/nonexistent"))
    trainer = InnerTrainer(task, lr=3e-3)
    start = init_state(task, 0)
    loss0, ppl0 = trainer.evaluate(start.params)
    assert abs(loss0 - math.log(256)) < 0.1  # an untrained model guesses bytes uniformly
    trainer.start(start)
    trainer.train_shard(shard_indices(task.n_train, 0, 0, 0, 1, 40, 32))
    params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    loss, ppl = trainer.evaluate(params)
    assert loss < loss0 - 1.0
    for value, exp in ((ppl0, loss0), (ppl, loss)):
        assert value == pytest.approx(math.exp(exp), rel=1e-4)

    export_model(start, task, tmp_path / "m.safetensors", {"eval_loss": loss0})
    sidecar = (tmp_path / "m.json").read_text()
    assert task.spec.info["corpus_sha256"] in sidecar
