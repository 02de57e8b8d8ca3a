"""Will a job fit on this peer? The memory training needs, against what there is.

ttpeer trains a whole copy of the model on every peer; it does not split one
model across machines. So before training, a peer estimates what the job needs
and declines a job it cannot hold, saying what would fit instead.

For a model with M bytes of state (parameters and buffers, in their dtypes), P
bytes of trainable parameters and F bytes of fp32 floating state, a fused job's peer
holds at its peak:

    on the training device
      local model                 M
      gradients                   P    (freed after each shard; the evaluation model of a
                                       round's close takes their place: not counted again)
      AdamW moments               2P
      activations                 one batch's forward pass, measured on the meta device
    in host memory, fp32 (the same memory when training on the CPU)
      held states                 0    none in memory: every state the executor holds is
                                       a file, read when used (a shard's start reads the
                                       base's params into the local model, the delta and
                                       the close read the base a tensor at a time)
      error-feedback residual     F
      the largest working copy    2F   the delta being encoded and its quantized rest, or
                                       at a round's close the running sum of its deltas
                                       becoming the new state (deltas are added one at a
                                       time: their number does not count). A checkpoint
                                       costs none: it goes file to file, sealed and
                                       uploaded a MiB at a time
      with overlap: eager start   F    the params of this round's estimated start
                    own delta     F    the last pseudo-gradient this peer published
    and the runtime               RUNTIME bytes: torch's own code and buffers in the
                                  worker, the daemon, the spare worker (measured by
                                  ``scripts/bench/memory``). Not part of ``total``: the
                                  memory a peer finds free is already net of it; in
                                  ``resident``, which is what RSS shows at the peak

Activations are measured by running one batch through the model on torch's
meta device (no memory is allocated) and adding up the tensors autograd saves
for the backward pass (but the model's own weights, and views of them), plus the
output and its gradient. That misses what a kernel allocates as scratch and counts
a tensor saved twice twice, so it is an estimate, not a promise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ttpeer._figures import count as _count
from ttpeer._figures import size as _size

from ._adapters import qlora_problem
from ._spec import LoadedTask, fetch_batch
from ._tasks import check_model

# Measured (scripts/bench/memory, docs/benchmarks.md): a peer's processes before any
# model (the daemon, a worker with torch loaded, the spare worker) and what torch and the
# allocator keep beside the tensors counted above.
RUNTIME = 384 << 20
NF4_BYTES = 0.516  # a 4-bit weight: 4 bits, and its block's scale (double-quantized, ~0.127 bits)


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a peer needs for a job, by what holds them. ``params``: a count."""

    params: int
    model: int
    eval_copy: int
    grads: int
    optimizer: int
    activations: int
    host: int  # the outer copies, fp32 in host memory
    total_params: int = 0  # trained and frozen (a LoRA base): a count
    runtime: int = 0  # host memory of the processes before any model: torch, the daemon

    @property
    def device(self) -> int:
        """Bytes on the training device."""
        return self.model + self.eval_copy + self.grads + self.optimizer + self.activations

    @property
    def total(self) -> int:
        """What the job needs beyond what the peer's processes already hold: what the fit
        check compares with the memory free (which the runtime is already out of)."""
        return self.device + self.host

    @property
    def resident(self) -> int:
        """The peer's processes at the job's peak, runtime included: what RSS shows."""
        return self.total + self.runtime


def memory_need(task: LoadedTask, *, batch_size: int, shards: int, held_states: int = 3,
                members: int = 0, overlap: bool = False, checkpointing: bool = False) -> MemoryNeed:
    """Estimate what training ``task`` in a job of ``shards`` shards with (micro-)batches of
    ``batch_size`` needs; ``held_states``: outer states the executor keeps at once;
    ``members``: for an ensemble, how many members every held state carries; ``overlap``:
    the job overlaps rounds (an eager start and the peer's own last delta are held);
    ``checkpointing``: activations are measured with the model's activation checkpointing on.
    Nothing is allocated: the model is built on the meta device. Raises TaskError
    if the model cannot be built."""
    model = check_model(task.spec, f"task {task.name}")
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if checkpointing and callable(enable):
        enable()
    state = model.state_dict()
    local = _resident_bytes(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in trainable)
    fp32 = sum(t.numel() * 4 for t in state.values() if t.is_floating_point())
    copies = 1 + 2 + (2 if overlap else 0)  # see the module's docstring: not per shard
    eval_copy = 0
    if members:
        # An ensemble state holds every member's weights, AdamW moments and a spare
        # section (6 fp32 copies a member); the round's member checkpoints (weights and
        # moments) arrive beside the held states, and the vote holds every member once.
        copies = 2 + 6 * members * held_states + 3 * members + members
        eval_copy = local
    return MemoryNeed(
        params=sum(p.numel() for p in trainable), total_params=sum(p.numel() for p in model.parameters()),
        model=local, eval_copy=eval_copy, grads=grads,
        optimizer=2 * grads, activations=_activations(model, task, batch_size, fallback=local),
        host=copies * fp32, runtime=RUNTIME,
    )


def _resident_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers on the device, each tensor once: the
    trained ones and, for adapters, the frozen base at its dtype. A 4-bit QLoRA base,
    built here at its compute dtype, counts NF4's 4 bits and its scales for the weights
    of its linear layers, as ``bitsandbytes`` stores them, and fp32 for the rest of it
    (the head, the embeddings, the norms), as peft's ``prepare_model_for_kbit_training``
    casts them."""
    four_bit = getattr(model, "ttpeer_base_bits", 16) == 4
    head = getattr(getattr(model, "hf", None), "get_output_embeddings", lambda: None)()
    quantized = {id(m.weight) for m in model.modules() if four_bit and isinstance(m, nn.Linear)
                 and m is not head and not m.weight.requires_grad}
    total = 0.0
    for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values():
        if id(t) in quantized:
            total += t.numel() * NF4_BYTES
        elif four_bit and t.is_floating_point():
            total += t.numel() * 4
        else:
            total += t.numel() * t.element_size()
    return int(total)


def warm_up() -> None:
    """Load what the first ``memory_need`` of a process would otherwise load on a job's
    critical path: torch's meta-device kernels and decompositions (about a second on a
    cold process, measured on the mnist1d MLP). The daemon calls it in a worker thread
    at start-up, while it logs in and syncs records; it allocates nothing."""
    saved = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal saved
        saved += t.numel()
        return t

    tokens = torch.zeros(2, 3, dtype=torch.long, device="meta")
    embed = nn.Embedding(8, 4, device="meta")
    layers = nn.Sequential(nn.LayerNorm(4, device="meta"), nn.Linear(4, 4, device="meta"), nn.ReLU(),
                           nn.GELU(), nn.Linear(4, 8, device="meta"))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = layers(embed(tokens))
        F.cross_entropy(logits.view(-1, 8), tokens.view(-1))
        F.cross_entropy(layers(torch.zeros(2, 4, device="meta")), tokens[:, 0])


def _activations(model: nn.Module, task: LoadedTask, batch_size: int, *, fallback: int) -> int:
    """Bytes autograd keeps for one batch's backward pass, measured on the meta device;
    ``fallback`` when the model cannot run there (it was not built on meta, or an op
    has no meta kernel)."""
    if not any(p.is_meta for p in model.parameters()):
        return fallback
    saved = 0
    weights = {id(p) for p in model.parameters()}

    def pack(t: Tensor) -> Tensor:
        nonlocal saved
        # A weight autograd keeps (a frozen base's for its input's gradient) is the model's
        # memory, counted already; a view of one (a transposed weight) is too.
        if id(t) not in weights and id(t._base) not in weights:
            saved += t.numel() * t.element_size()
        return t

    x, y = fetch_batch(task.train, [i % task.n_train for i in range(batch_size)])
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x.to("meta"))
            task.spec.loss(out, y.to("meta"))
    except Exception:  # the task's own code: anything can happen on meta tensors
        return fallback
    return saved + 2 * out.numel() * out.element_size() if isinstance(out, Tensor) else saved


@dataclass(frozen=True)
class Misfit:
    """A job that does not fit: the message a peer declines with, and the bytes it
    needs and has in the memory that is short."""

    message: str
    need: int
    have: int


def fit_problem(need: MemoryNeed, *, device: str, device_free: int, host_free: int,
                limited: bool = False, micro_batch: int | None = None) -> Misfit | None:
    """None if ``need`` fits in ``device_free`` bytes on ``device`` (and, off the CPU,
    its outer copies in ``host_free`` bytes of host memory); else what the peer
    declines with: what it needs, what there is, and the largest model that would fit.
    ``limited``: ``device_free`` is the ``memory_limit`` setting, not what is free;
    ``micro_batch``: ``need`` counts the activations of micro-batches of that many samples."""
    on_cpu = not device.startswith(("cuda", "mps", "xpu"))
    # Per parameter of the whole model (a LoRA base's frozen ones too): what a model of
    # another size, adapted the same way, would need.
    count = max(need.total_params, need.params, 1)
    per_param_device = (need.model + need.eval_copy + need.grads + need.optimizer) / count
    per_param_host = need.host / count
    if on_cpu:
        if need.total <= device_free:
            return None
        short, have, where = need.total, device_free, "memory"
        room = (device_free - need.activations) / (per_param_device + per_param_host)
    else:
        if need.device <= device_free and need.host <= host_free:
            return None
        room = min((device_free - need.activations) / per_param_device, host_free / per_param_host)
        if need.device > device_free:
            short, have, where = need.device, device_free, f"memory on {device}"
        else:
            short, have, where = need.host, host_free, "host memory for the outer copies"
            limited = False
    if room >= 1:
        fits = f"a model of up to about {_count(int(room))} parameters would fit here"
    elif micro_batch is None:
        fits = (f"no model fits here with this batch size: one batch's activations alone need about "
                f"{_size(need.activations)} (a smaller --batch-size needs less)")
    else:
        fits = (f"no model fits here: the activations of one micro-batch of {micro_batch} alone need "
                f"about {_size(need.activations)}")
    setting = " (its memory_limit setting)" if limited else ""
    what = (f"adapters of {_count(need.params)} parameters over this frozen {_count(need.total_params)}-parameter "
            "model" if need.total_params > need.params else f"this model ({_count(need.params)} parameters)")
    message = (f"training {what} needs about {_size(short)} of {where} "
               f"(weights, gradients, AdamW state, outer copies and activations) and this peer has "
               f"{_size(have)}{setting}; ttpeer does not split one model across machines, so this peer "
               f"declines the job; {fits}")
    return Misfit(message, short, have)


@dataclass(frozen=True)
class BatchFit:
    """How a peer trains a job's batches: ``micro_batch`` samples per forward/backward
    pass (the whole batch when it fits), what that needs, and ``misfit`` when even the
    smallest micro-batch tried does not fit."""

    micro_batch: int
    need: MemoryNeed
    misfit: Misfit | None


def fit_batch(task: LoadedTask, *, batch_size: int, forced: int | None = None, device: str, device_free: int,
              host_free: int, limited: bool = False, **need: Any) -> BatchFit:
    """The largest micro-batch of a ``batch_size`` batch that fits: the whole batch, else
    half of it, a quarter, ... down to one sample (``forced``: that one only). ``need``:
    ``memory_need``'s other arguments. A peer that cannot hold the batch but can hold a
    micro-batch trains the job with gradient accumulation instead of declining it. A
    QLoRA task (a 4-bit base) does not fit a peer that cannot load one (``qlora_problem``)."""
    sizes = [forced] if forced is not None else _halvings(batch_size)
    lora = task.spec.lora
    if lora is not None and lora.base_bits == 4 and (problem := qlora_problem(device)):
        return BatchFit(sizes[0], memory_need(task, batch_size=sizes[0], **need), Misfit(problem, 0, 0))
    for size in sizes:
        needed = memory_need(task, batch_size=size, **need)
        misfit = fit_problem(needed, device=device, device_free=device_free, host_free=host_free, limited=limited,
                             micro_batch=size if size < batch_size else None)
        if misfit is None:
            return BatchFit(size, needed, None)
    if misfit is not None and size < batch_size:
        what = "the forced --micro-batch of" if forced is not None else "micro-batches down to"
        misfit = replace(misfit, message=f"{misfit.message} ({what} {size} sample{'s' * (size > 1)} tried)")
    hf = task.spec.info.get("hf") == "causal_lm"
    if misfit is not None and hf and not need.get("checkpointing"):
        misfit = replace(misfit, message=f"{misfit.message}; --checkpointing (activation checkpointing) keeps "
                                         "a fraction of the activations")
    if misfit is not None and hf and task.spec.lora is None:
        misfit = replace(misfit, message=f"{misfit.message}; to fine-tune it on this peer, train adapters over "
                                         "the frozen model: hf_causal_lm(..., lora=LoRA()) needs a fraction of this")
    return BatchFit(size, needed, misfit)


def _halvings(batch_size: int) -> list[int]:
    sizes = [batch_size]
    while sizes[-1] > 1:
        sizes.append(-(-sizes[-1] // 2))
    return sizes
