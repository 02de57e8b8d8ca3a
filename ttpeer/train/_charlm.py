"""The built-in ``charlm`` task: a small character-level transformer trained on
the Python standard library's own sources.

The corpus is every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``
(about 10.9 MB on CPython 3.11), skipping tests, ``idlelib``, ``tkinter``,
``lib2to3`` and ``site-packages``, read in sorted path order, so it is the same
bytes on every machine with the same Python. It changes with the Python
version: its sha256 goes into the task's ``source_hash`` (peers with another
Python decline the job as a different task) and into ``TaskSpec.info``, which
the export sidecar records next to the figures.

Characters are bytes (a vocabulary of 256, nothing to build or agree on). The
first 90% of the corpus trains, the last 10% validates. A sample is a window
of ``block_size`` bytes and the same window shifted by one; samples are views
into one uint8 tensor, so the corpus is held once, whatever the sample count.

The metric is perplexity, ``exp`` of the mean validation loss. The trainer
averages a task's metric over evaluation batches; the validation set is kept
to one evaluation batch (``VAL_SEQUENCES`` windows), so that average is the
exact perplexity.

Size: ``charlm`` is the tiny default (a pool round on 2 CPU cores takes
seconds); ``charlm:n_layer=6,d_model=384,block_size=256`` picks another size,
any ``CharLMConfig`` field as ``key=int``.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ._errors import TaskError
from ._spec import TaskSpec

NAME = "charlm"
VOCAB = 256
VAL_FRACTION = 0.1
VAL_SEQUENCES = 256  # at most the trainer's evaluation batch (1024): one batch, exact perplexity
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "tkinter", "lib2to3", "site-packages", "__pycache__"})
# Bump when the model or the data preparation changes: it changes source_hash.
_VERSION_TAG = "ttpeer-charlm-v1"


@dataclass(frozen=True)
class CharLMConfig:
    """The whole model and data configuration (nanoGPT's GPTConfig, smaller)."""

    block_size: int = 64  # context length in bytes
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64  # must be a multiple of n_head

    def check(self) -> CharLMConfig:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
                raise TaskError(f"charlm: {f.name} must be an int from 1 to {1 << 20}, got {value!r}")
        if self.d_model % self.n_head:
            raise TaskError(f"charlm: d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")
        return self


def parse_config(spec: str) -> CharLMConfig:
    """``"charlm"`` or ``"charlm:key=int,..."`` -> its config. Raises TaskError."""
    _, _, rest = spec.partition(":")
    known = {f.name for f in fields(CharLMConfig)}
    changes: dict[str, int] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise TaskError(f"charlm: cannot read {item!r}; write key=int with key one of {sorted(known)}")
        try:
            changes[key] = int(value)
        except ValueError:
            raise TaskError(f"charlm: {key} must be an int, got {value!r}") from None
    return replace(CharLMConfig(), **changes).check()


# -- the model ------------------------------------------------------------------------


class SelfAttention(nn.Module):
    def __init__(self, cfg: CharLMConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: CharLMConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    """Byte embeddings plus learned positions, pre-norm blocks, a linear head."""

    def __init__(self, cfg: CharLMConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.Sequential(*(Block(cfg) for _ in range(cfg.n_layer)))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB)
        self.checkpointing = False  # not state: every peer chooses for itself
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        """(batch, time) bytes of any integer dtype -> (batch, time, 256) logits."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx.long()) + self.pos(positions)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing and self.training else block(x)
        return self.head(self.ln(x))

    def gradient_checkpointing_enable(self) -> None:
        """Keep only each block's input for the backward pass and recompute the rest
        there (Hugging Face's name for it): activations of one block instead of all,
        for about a third more compute per step."""
        self.checkpointing = True


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy per byte, in nats."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1).long())


def perplexity(logits: Tensor, target: Tensor) -> float:
    """``exp`` of the batch's mean loss (exact over the one-batch validation set)."""
    return math.exp(lm_loss(logits, target).item())


# -- the data -------------------------------------------------------------------------


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path) -> list[Path]:
    """The corpus's files in the order they are concatenated (sorted relative paths)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


@lru_cache(maxsize=2)
def load_corpus(root: Path) -> tuple[Tensor, str]:
    """All corpus bytes as one uint8 tensor, and their sha256. Cached per process:
    peers run in one process in tests and the demo. Raises TaskError when there are
    no sources to read."""
    files = corpus_files(root)
    if not files:
        raise TaskError(f"charlm: no .py sources under {root}; this Python ships without its standard "
                        "library sources, so charlm cannot run here")
    try:
        data = b"".join(p.read_bytes() for p in files)
    except OSError as exc:
        raise TaskError(f"charlm: cannot read the corpus under {root}: {exc}") from exc
    corpus = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return corpus, hashlib.sha256(data).hexdigest()


def windows(data: Tensor, block: int, count: int | None = None) -> tuple[Tensor, Tensor]:
    """Non-overlapping ``(x, y)`` windows of ``data`` (y is x shifted by one byte),
    as views; with ``count``, that many windows spread evenly over ``data``."""
    n = (len(data) - 1) // block
    if n < 1:
        raise TaskError(f"charlm: the corpus is shorter than one block of {block} bytes")
    x, y = data[: n * block].view(n, block), data[1: n * block + 1].view(n, block)
    if count is not None and count < n:
        pick = torch.linspace(0, n - 1, count).long()
        x, y = x[pick], y[pick]
    return x, y


def charlm_task(spec: str = NAME, root: Path | None = None) -> tuple[TaskSpec, str]:
    """Return the charlm ``TaskSpec`` for ``spec`` and its source hash.

    Raises TaskError for a bad size in ``spec`` or a missing corpus.
    """
    cfg = parse_config(spec)
    corpus, corpus_hash = load_corpus(root or stdlib_root())
    split = int(len(corpus) * (1 - VAL_FRACTION))
    info = {"corpus": "python stdlib .py sources", "corpus_sha256": corpus_hash,
            "corpus_bytes": str(len(corpus)), "python": sysconfig.get_python_version(),
            **{k: str(v) for k, v in asdict(cfg).items()}}
    task = TaskSpec(
        model=lambda: CharLM(cfg),
        train=windows(corpus[:split], cfg.block_size),
        test=windows(corpus[split:], cfg.block_size, VAL_SEQUENCES),
        loss=lm_loss,
        metric=perplexity,
        metric_name="perplexity",
        batch_size=64,
        info=info,
    )
    source = "\n".join([_VERSION_TAG, corpus_hash, *(f"{k}={v}" for k, v in sorted(asdict(cfg).items()))])
    return task, hashlib.sha256(source.encode()).hexdigest()
