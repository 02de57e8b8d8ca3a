"""``dataset_path(name)``: a task reads a dataset the pool holds instead of a path of its own.

Theory of operation. Task code runs only while ttpeer loads a task, and ttpeer loads a
task under ``resolving(resolver)``: the resolver maps a dataset's name to the local folder
that holds its files on this peer, or raises ``DatasetMissing``. ``dataset_path`` asks the
resolver and remembers each name it answered, with the dataset id; the executor reads those
(``DatasetResolver.used``) after the task loaded. At submit the resolver knows the datasets
held here by name, and the job records what the task used; on every other peer it knows
only the job's names, mapped to the ids the job recorded, and the daemon has fetched and
verified those files before the task loads. So a task that reads ``dataset_path("corpus")``
reads the same bytes on every peer.

What breaks it: task code that keeps the path and reads it outside ``task()`` after the
daemon evicted the dataset (it never evicts one a running job uses), or a task that calls
``dataset_path`` when ttpeer is not loading it (a plain ``python my_task.py``): that raises
``TaskError`` saying so.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ._errors import DatasetMissing, TaskError
from ._samples import SampleIndex, Samples, open_samples

# (dataset id, samples hash, {"piece_size", "files": [[path, size]], "samples": {...}}, datasets root)
IndexFound = tuple[str, str, dict[str, Any], Path]


def _no_samples(name: str) -> IndexFound:
    raise TaskError(f"dataset_samples({name!r}) is not available here")


@dataclass
class DatasetResolver:
    """``find(name)`` -> (dataset id, folder of its files); ``find_samples(name)`` -> its
    sample index (``IndexFound``); both raise ``DatasetMissing``. ``used``: every name asked
    for while loading, with the id it resolved to; ``used_samples``: those read sample by
    sample, with the hash of the index."""

    find: Callable[[str], tuple[str, Path]]
    find_samples: Callable[[str], IndexFound] = _no_samples
    used: dict[str, str] = field(default_factory=dict)
    used_samples: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)


class HeldDatasets(Protocol):
    """Where datasets are held by name (the daemon's ``DataStore`` is one)."""

    root: Path

    def find(self, name: str) -> tuple[str, Any] | None: ...
    def find_partial(self, name: str) -> str | None: ...
    def files(self, dataset: str) -> Path: ...
    def index(self, dataset: str, digest: str | None = None) -> tuple[str, dict[str, Any]] | None: ...


def held_resolver(store: HeldDatasets) -> DatasetResolver:
    """``dataset_path(name)`` answered by the dataset called ``name`` that ``store`` holds
    (at submit, and for ``ttpeer.load`` without a daemon); ``DatasetMissing`` if none.
    ``dataset_samples(name)`` also by one this store holds in part (its index and some pieces)."""
    def find(name: str) -> tuple[str, Path]:
        hit = store.find(name)
        if hit is None:
            raise DatasetMissing(name)
        return hit[0], store.files(hit[0])

    def find_samples(name: str) -> IndexFound:
        hit = store.find(name)
        dataset = hit[0] if hit is not None else store.find_partial(name)
        found = store.index(dataset) if dataset is not None else None
        if dataset is None or found is None:
            raise DatasetMissing(name, whole=False)
        return dataset, found[0], found[1], store.root

    return DatasetResolver(find, find_samples)


_local = threading.local()  # tasks load in worker threads, one task at a time per thread


@contextlib.contextmanager
def resolving(resolver: DatasetResolver) -> Iterator[DatasetResolver]:
    """Load a task with ``dataset_path`` answered by ``resolver`` (in this thread)."""
    before = getattr(_local, "resolver", None)
    _local.resolver = resolver
    try:
        yield resolver
    finally:
        _local.resolver = before


def dataset_path(name: str) -> Path:
    """The local folder holding the files of the pool's dataset ``name`` (added with
    ``ttpeer data add PATH --name NAME``), laid out as they were added: a file added alone
    is ``dataset_path(name) / its file name``. Call it inside ``task()``.

    Raises ``TaskError`` outside a task ttpeer loads, or for a name that is not a string;
    ``DatasetMissing`` when this peer does not hold it (the daemon then fetches it)."""
    resolver = _current(name, "dataset_path")
    try:
        dataset, folder = resolver.find(name)
    except DatasetMissing:
        resolver.missing.append(name)
        raise
    resolver.used[name] = dataset
    return folder


def dataset_samples(name: str, transform: Callable[[Any], Any] | None = None) -> Samples:
    """The pool's dataset ``name`` as a map-style dataset of its samples, read piece by
    piece: a peer fetches only the pieces of the shards it trains (and of the test set).
    The dataset must have been added with ``ttpeer data add PATH --name NAME --format F``
    (``lines``: each item a line as ``bytes``, its newline left out; ``records:N``: N-byte
    ``bytes``; ``npy``: a numpy row; ``tar``: ``{extension: bytes}``; ``parquet``: a row as
    ``{column: value}``, which needs pyarrow). ``transform(raw)`` makes each item, e.g. ``(x, y)``
    tensors. ``.split(test=N)`` holds the last N samples out as a test set. Call it inside
    ``task()``; raises ``TaskError`` as ``dataset_path`` does, or when the dataset has no
    sample index (added without ``--format``)."""
    resolver = _current(name, "dataset_samples")
    try:
        dataset, digest, spec, root = resolver.find_samples(name)
    except DatasetMissing:
        resolver.missing.append(name)
        raise
    files = [(str(p), int(n)) for p, n in spec["files"]]
    index = SampleIndex(name, dataset, digest, root, int(spec["piece_size"]), files, dict(spec["samples"]))
    resolver.used[name] = dataset
    resolver.used_samples[name] = digest
    return open_samples(index, transform)


def _current(name: Any, what: str) -> DatasetResolver:
    resolver: DatasetResolver | None = getattr(_local, "resolver", None)
    if resolver is None:
        raise TaskError(f"{what}({name!r}) works inside task() while ttpeer loads the task "
                        "(submit, or a peer preparing the job), not elsewhere")
    if not isinstance(name, str):
        raise TaskError(f"{what}() takes a dataset's name (a str), not {type(name).__name__}")
    return resolver
