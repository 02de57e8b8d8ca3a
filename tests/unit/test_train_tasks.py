"""Task loading: the built-in mnist1d, task files, and clear errors for broken ones."""

import hashlib
import textwrap
from pathlib import Path

import pytest
import torch

from ttpeer.train import LoadedTask, TaskError, TaskSpec, load_task

torch.set_num_threads(1)

FIXTURE = Path(__file__).parent / "fixtures" / "task_linear.py"

HEADER = """
import torch
import torch.nn.functional as F
from torch import nn
from ttpeer.train import TaskSpec
X, Y = torch.randn(20, 3), torch.randint(0, 2, (20,))
"""


def _write(tmp_path: Path, body: str, name: str = "broken_task.py") -> Path:
    path = tmp_path / name
    path.write_text(HEADER + textwrap.dedent(body))
    return path


def test_fixture_task_loads():
    task = load_task(str(FIXTURE), Path("/nonexistent"))
    assert isinstance(task, LoadedTask) and isinstance(task.spec, TaskSpec)
    assert task.name == "task_linear"
    assert (task.n_train, task.n_test, task.batch_size) == (256, 128, 16)
    assert task.source_hash == hashlib.sha256(FIXTURE.read_bytes()).hexdigest()
    x, y = task.train[3]
    assert x.shape == (8,) and y.dtype == torch.long
    again = load_task(str(FIXTURE), Path("/nonexistent"))
    assert torch.equal(again.train.tensors[0], task.train.tensors[0])  # fixed generator


def test_dict_and_dataset_tasks_are_accepted(tmp_path):
    path = _write(tmp_path, """
        class Pairs(torch.utils.data.Dataset):
            def __len__(self):
                return 20
            def __getitem__(self, i):
                return X[i], Y[i]
        def task():
            return {"model": lambda: nn.Linear(3, 2), "train": Pairs(), "test": (X, Y),
                    "loss": F.cross_entropy, "metric": lambda o, t: 0.5}
    """, name="dict_task.py")
    task = load_task(str(path), tmp_path, {"slowdown": 0.5, "step_s": 0.25})
    assert task.n_train == 20 and task.metric_name == "accuracy" and task.slowdown == 0.5
    assert task.step_s == 0.25


@pytest.mark.parametrize("body,message", [
    ("def task(:\n    pass\n", r"broken_task\.py:7: syntax error: invalid syntax"),
    ("raise RuntimeError('boom')\n", "failed while importing: RuntimeError: boom"),
    ("def other():\n    pass\n", "defines no task"),
    ("task = 3\n", "defines no task"),
    ("def task():\n    return 42\n", "returned int"),
    ("def task():\n    raise ValueError('no data')\n", "raised ValueError: no data"),
    ("def task():\n    return {'model': 1}\n", "missing"),
    ("def task():\n    return dict(model=lambda: nn.Linear(3, 2), train=(X, Y), test=(X, Y),"
     " loss=F.cross_entropy, metric=len, colour=1)\n", "unknown keys"),
    ("def task():\n    return TaskSpec(model=lambda: 'model', train=(X, Y), test=(X, Y),"
     " loss=F.cross_entropy, metric=len)\n", "expected a torch.nn.Module"),
    ("def task():\n    return TaskSpec(model=lambda: nn.Linear(3, 2), train=(X[:0], Y[:0]),"
     " test=(X, Y), loss=F.cross_entropy, metric=len)\n", "train dataset is empty"),
    ("def task():\n    return TaskSpec(model=lambda: nn.Linear(3, 2), train=(X, Y[:5]),"
     " test=(X, Y), loss=F.cross_entropy, metric=len)\n", "same first dimension"),
    ("def task():\n    return TaskSpec(model=lambda: nn.Linear(3, 2), train=(X, Y),"
     " test=[1, 2, 3], loss=F.cross_entropy, metric=len)\n", "test must be an"),
    ("def task():\n    return TaskSpec(model=lambda: nn.Linear(3, 2), train=(X, Y),"
     " test=(X, Y), loss=F.cross_entropy, metric=len, batch_size=0)\n", "batch_size"),
    ("def task():\n    return TaskSpec(model=lambda: nn.Linear(3, 2), train=(X, Y),"
     " test=(X, Y), loss=None, metric=len)\n", "loss must be callable"),
])
def test_broken_task_files_name_the_file(tmp_path, body, message):
    path = _write(tmp_path, body)
    with pytest.raises(TaskError, match=message) as info:
        load_task(str(path), tmp_path)
    assert str(path) in str(info.value)


def test_missing_file_and_unknown_spec(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(TaskError, match=f"{missing} does not exist"):
        load_task(str(missing), tmp_path)
    with pytest.raises(TaskError, match="unknown task 'cifar'"):
        load_task("cifar", tmp_path)


@pytest.mark.parametrize("options", [{"speed": 1}, {"slowdown": -1.0}, {"slowdown": "x"},
                                     {"slowdown": float("inf")}, {"step_s": -0.5}, {"step_s": True},
                                     {"step_s": float("nan")}])
def test_bad_options_raise_task_error(options):
    with pytest.raises(TaskError, match="option"):
        load_task(str(FIXTURE), Path("/nonexistent"), options)


@pytest.mark.slow
def test_mnist1d_is_cached_and_hashed(tmp_path):
    first = load_task("mnist1d", tmp_path)
    assert (tmp_path / "mnist1d.npz").exists()
    assert (first.n_train, first.n_test, first.batch_size) == (16000, 4000, 64)
    x, y = first.train[0]
    assert x.shape == (40,) and x.dtype == torch.float32 and 0 <= int(y) < 10
    second = load_task("mnist1d", tmp_path)  # from the cache
    assert second.source_hash == first.source_hash and len(first.source_hash) == 64
    assert torch.equal(second.test.tensors[0], first.test.tensors[0])
    small = load_task("mnist1d:samples=500", tmp_path)  # the default takes a while to make: a torn
    (tmp_path / "mnist1d-500.npz").write_bytes(b"torn")  # cache is checked on a small one
    assert load_task("mnist1d:samples=500", tmp_path).source_hash == small.source_hash  # regenerated


@pytest.mark.slow
def test_mnist1d_with_more_samples_is_its_own_task_and_cache(tmp_path):
    fewer = load_task("mnist1d:samples=500", tmp_path)  # sizes other than the default, which is slow to make
    more = load_task("mnist1d:samples=6000", tmp_path)
    assert (more.n_train, more.n_test) == (4800, 1200)
    assert (tmp_path / "mnist1d-6000.npz").exists() and (tmp_path / "mnist1d-500.npz").exists()
    assert more.source_hash != fewer.source_hash and more.name == "mnist1d:samples=6000"
    # the same generator with more draws: every peer that asks for 6000 gets the same signals
    (tmp_path / "mnist1d-6000.npz").unlink()
    assert load_task("mnist1d:samples=6000", tmp_path).source_hash == more.source_hash
    # a cache of another size under the name is not trusted
    (tmp_path / "mnist1d-6000.npz").write_bytes((tmp_path / "mnist1d-500.npz").read_bytes())
    assert load_task("mnist1d:samples=6000", tmp_path).n_train == 4800


@pytest.mark.parametrize("spec", ["mnist1d:samples=", "mnist1d:samples=12", "mnist1d:size=6000",
                                  "mnist1d:samples=-5", "mnist1d:samples=99999999",
                                  "mnist1d:samples=\u00b2\u00b2\u00b2"])
def test_bad_mnist1d_options_say_what_is_allowed(tmp_path, spec):
    with pytest.raises(TaskError, match="samples=N"):
        load_task(spec, tmp_path)


def test_mnist1d_data_is_made_once_per_machine_and_shared_by_its_homes(tmp_path, monkeypatch):
    from ttpeer.train import _mnist1d

    shared = tmp_path / "cache" / "data"
    first = load_task("mnist1d:samples=500", tmp_path / "home1", shared_data=shared)
    assert (shared / "mnist1d-500.npz").exists() and (tmp_path / "home1" / "mnist1d-500.npz").exists()

    def no_generation(samples: int) -> None:
        raise AssertionError("generated again although the machine holds the data")

    monkeypatch.setattr(_mnist1d, "_generate", no_generation)
    (tmp_path / "home2").mkdir()
    second = load_task("mnist1d:samples=500", tmp_path / "home2", shared_data=shared)
    assert second.source_hash == first.source_hash and (tmp_path / "home2" / "mnist1d-500.npz").exists()
    monkeypatch.undo()
    (shared / "mnist1d-500.npz").write_bytes(b"torn")  # a damaged machine copy is made again
    (tmp_path / "home3").mkdir()
    assert load_task("mnist1d:samples=500", tmp_path / "home3", shared_data=shared).source_hash == first.source_hash
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")  # a machine copy that cannot be written is only not used
    (tmp_path / "home4").mkdir()
    assert load_task("mnist1d:samples=500", tmp_path / "home4", shared_data=blocked / "data").n_train == 400
