"""LoRA adapters over a frozen model: what a task asks for (``LoRA``) and how its model is
built with them (``adapted``), on the ``peft`` library.

The contract the rest of ttpeer relies on: an adapted model's ``state_dict()`` holds its
trainable tensors only (the adapters, fp32), so they alone are the job's state: averaged,
compressed, sent, hashed, checkpointed and exported. The frozen base is never part of it:
every peer builds it from its own copy (the task's hash covers those files), and
``load_state_dict`` does not miss it. Peers therefore agree bit for bit on the adapters,
and each holds a base it loaded itself.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._errors import TaskError

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoRA:
    """Low-rank adapters (Hu et al. 2021) over a frozen base, for ``TaskSpec.lora`` or
    ``hf_causal_lm(lora=...)``: each targeted linear layer ``W`` becomes
    ``W x + (alpha / r) B A x`` with ``A`` (r x in) and ``B`` (out x r) trained, ``B``
    starting at zero so training starts from the base model exactly.

    ``target_modules``: ``"all-linear"`` (every linear layer but the output head, for a
    Hugging Face model), or module names (a name matches a module whose dotted path ends
    with it, e.g. ``["q_proj", "v_proj"]``). ``base_bits``: 16 keeps the base at the dtype
    its folder stores (fp32 on a peer without CUDA, where bf16 matmuls are slow); 4 loads
    it in 4-bit NF4 through ``bitsandbytes`` (QLoRA, Dettmers et al. 2023), CUDA only.
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    target_modules: str | Sequence[str] = ALL_LINEAR
    base_bits: int = 16

    def check(self, where: str) -> None:
        """Raises TaskError naming ``where`` for a setting out of range."""
        if isinstance(self.r, bool) or not isinstance(self.r, int) or not 1 <= self.r <= 4096:
            raise TaskError(f"{where}: LoRA r must be an int from 1 to 4096, got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not 0 < self.alpha < math.inf:
            raise TaskError(f"{where}: LoRA alpha must be a positive number, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float) \
                or not 0 <= self.dropout < 1:
            raise TaskError(f"{where}: LoRA dropout must be in [0, 1), got {self.dropout!r}")
        targets = self.targets()
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise TaskError(f"{where}: LoRA target_modules must be 'all-linear' or a list of module names, "
                            f"got {self.target_modules!r}")
        if self.base_bits not in (4, 16):
            raise TaskError(f"{where}: LoRA base_bits must be 16 (the folder's dtype) or 4 (QLoRA), "
                            f"got {self.base_bits!r}")

    def targets(self) -> str | list[str]:
        """``"all-linear"``, or the module names (one name given as a string is a list of it:
        peft would read a string as a pattern over whole dotted paths)."""
        t = self.target_modules
        if isinstance(t, str):
            return t if t == ALL_LINEAR else [t]
        return list(t)

    def key(self) -> str:
        """The settings as canonical JSON: part of the task's hash (peers must train the
        same adapters) and of the export's sidecar (``from_key`` reads it back)."""
        targets = self.targets()
        return json.dumps({"r": self.r, "alpha": float(self.alpha), "dropout": float(self.dropout),
                           "target_modules": targets if isinstance(targets, str) else sorted(targets),
                           "base_bits": self.base_bits}, sort_keys=True)

    @classmethod
    def from_key(cls, text: str) -> LoRA:
        """The settings ``key`` wrote. Raises ValueError for anything else."""
        try:
            fields = json.loads(text)
            return cls(r=int(fields["r"]), alpha=float(fields["alpha"]), dropout=float(fields["dropout"]),
                       target_modules=fields["target_modules"], base_bits=int(fields["base_bits"]))
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"not LoRA settings: {text[:80]!r}") from exc

    def peft_config(self, *, causal_lm: bool) -> Any:
        """The ``peft.LoraConfig`` for these settings."""
        peft = peft_module()
        return peft.LoraConfig(r=self.r, lora_alpha=float(self.alpha), lora_dropout=float(self.dropout),
                               target_modules=self.targets(), bias="none",
                               task_type="CAUSAL_LM" if causal_lm else None)


def peft_module() -> Any:
    """``peft``, imported lazily; TaskError saying how to install it when missing."""
    try:
        import peft
    except ImportError:
        raise TaskError("LoRA adapters need the peft library: pip install 'ttpeer[hf]'") from None
    return peft


def qlora_problem(device: str) -> str | None:
    """Why a peer training on ``device`` cannot load a 4-bit (QLoRA) base, saying what
    would work; None if it can."""
    if not device.startswith("cuda"):
        return ("QLoRA (LoRA(base_bits=4)) needs a CUDA GPU, and this peer trains on "
                f"{device}; LoRA over the base at its own dtype (base_bits=16, the default) trains here")
    try:
        importlib.import_module("bitsandbytes")  # an optional extra: only whether it loads here
    except ImportError:
        return ("QLoRA (LoRA(base_bits=4)) needs bitsandbytes: pip install 'ttpeer[qlora]' on this peer, or "
                "use LoRA(base_bits=16)")
    return None


def adapted(build: Callable[[], nn.Module], lora: LoRA, where: str) -> Callable[[], nn.Module]:
    """``model()`` for a task with adapters: builds the task's model, then adds ``lora``'s
    adapters. A model with a ``with_lora(lora)`` method (``hf_causal_lm``'s) adds its own;
    any other module gets ``peft.get_peft_model`` with the named ``target_modules``. Raises
    TaskError when ``target_modules`` matches nothing, or names a layer peft cannot adapt."""

    def build_adapted() -> nn.Module:
        model = build()
        if not isinstance(model, nn.Module):
            return model  # check_model says what is wrong
        own = getattr(model, "with_lora", None)
        try:
            if callable(own):
                result = own(lora)
            else:
                if lora.targets() == ALL_LINEAR:
                    raise TaskError(f"{where}: target_modules='all-linear' is for Hugging Face models; name "
                                    "the layers to adapt, e.g. LoRA(target_modules=['fc1', 'fc2'])")
                result = freeze_outside_state(peft_module().get_peft_model(model, lora.peft_config(causal_lm=False)))
        except TaskError:
            raise
        except (ValueError, TypeError, KeyError) as exc:  # peft's NoMatchingPeftModuleError is a ValueError
            said = " ".join(str(exc).split())  # peft's text may hold a module's whole repr: one line, cut
            said = said if len(said) <= 200 else said[:200] + "..."
            names = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
            raise TaskError(f"{where}: LoRA target_modules {lora.target_modules!r}: {said}"
                            + (f" (the model's linear layers: {', '.join(names[:12])})" if names else "")) from None
        return result

    return build_adapted


def fresh_adapters(build: Callable[[], nn.Module]) -> nn.Module:
    """An adapted model whose adapters are initialised on the CPU (peft's own init: A
    uniform, B zero) from the torch generator, and whose frozen base stays on the meta
    device: the job's initial state without reading, or holding, the base's weights."""
    with torch.device("meta"):
        model = build()
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta and param.requires_grad:
                module._parameters[name] = nn.Parameter(torch.empty_like(param, device="cpu"))
    for module in model.modules():
        reset = getattr(module, "reset_lora_parameters", None)
        if callable(reset):
            for adapter in getattr(module, "lora_A", {}):
                reset(adapter, True)
    return model


def freeze_outside_state(model: nn.Module) -> nn.Module:
    """Make ``model``'s ``state_dict`` its trainable parameters only, and let
    ``load_state_dict`` not miss the rest (the frozen base). Returns ``model``."""
    model.__dict__["ttpeer_state"] = frozenset(n for n, p in model.named_parameters() if p.requires_grad)
    model.register_state_dict_post_hook(_keep_trainable)
    model.register_load_state_dict_post_hook(_frozen_not_missing)
    return model


def frozen_names(model: nn.Module) -> frozenset[str] | None:
    """The state names of an adapted model (its trainable parameters); None for a model
    whose state is its whole ``state_dict``."""
    return getattr(model, "ttpeer_state", None)


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameters (tied ones counted once)."""
    params = list(model.parameters())  # deduplicated by identity
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def _keep_trainable(module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
    keep = module.__dict__["ttpeer_state"]
    for name in [n for n in state if n.startswith(prefix) and n[len(prefix):] not in keep]:
        del state[name]


def _frozen_not_missing(module: nn.Module, incompatible: Any) -> None:
    keep = module.__dict__["ttpeer_state"]
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k in keep]
