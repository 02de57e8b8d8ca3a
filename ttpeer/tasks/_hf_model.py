"""The model half of ``hf_causal_lm``: a ``transformers`` causal LM from a local folder or
a config, checked, and wrapped to ttpeer's ``(x) -> logits`` contract.

What it promises: the wrapper's ``state_dict`` names are the Hugging Face model's own
(``transformer.h.0.attn.c_attn.weight``...), minus tied aliases (GPT-2's ``lm_head.weight``
is ``transformer.wte.weight``: one tensor, stored, averaged and sent once), so an export
loads back into ``AutoModelForCausalLM`` and a state dict of the HF model loads here.
Nothing is downloaded: every ``from_pretrained`` is ``local_files_only``, and a name
that is not a local folder is refused before transformers sees it. Weights are fp32
whatever the folder stores: ttpeer's master weights, deltas and hashes are fp32.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from ttpeer.train import LoRA, TaskError, freeze_outside_state, peft_module, qlora_problem

# Read once at import by huggingface_hub, datasets and transformers: set before they load.
_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1"}


def offline() -> None:
    """Make the Hugging Face libraries work offline in this process (they read these
    variables when first imported, so this runs before any of them is)."""
    for key, value in _OFFLINE.items():
        os.environ.setdefault(key, value)


def hf_modules() -> Any:
    """``transformers``, imported lazily; TaskError saying how to install it when missing."""
    offline()
    try:
        import transformers
    except ImportError:
        raise TaskError("hf_causal_lm needs the Hugging Face extra: pip install 'ttpeer[hf]' "
                        "(transformers, datasets, safetensors)") from None
    transformers.logging.set_verbosity_error()  # its warnings are not the user's to act on here
    transformers.logging.disable_progress_bar()  # a bar a load, in a daemon's log
    return transformers


class CausalLM(nn.Module):
    """A Hugging Face causal LM as a ttpeer model: ``(batch, time)`` token ids of any
    integer dtype -> ``(batch, time, vocab)`` logits.

    The HF model's children are adopted as this module's own, so parameter names are
    the HF names; ``hf`` is the HF model itself (not a submodule: that would prefix
    every name with ``hf.``). Tied aliases are left out of ``state_dict`` and not
    reported missing by ``load_state_dict``."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        for name, child in hf.named_children():
            self.add_module(name, child)
        for name, param in hf.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in hf.named_buffers(recurse=False):
            self.register_buffer(name, buf, persistent=name not in hf._non_persistent_buffers_set)
        self.__dict__["hf"] = hf
        self.tied = tied_aliases(hf)
        self.register_state_dict_post_hook(_drop_tied)
        self.register_load_state_dict_post_hook(_tied_not_missing)

    def forward(self, idx: Tensor) -> Tensor:
        mask = None
        if idx.is_meta:
            # The fit check runs the model on meta tensors, and transformers' own causal-mask
            # code reads values (which meta tensors lack); an explicit causal mask skips it.
            b, t = idx.shape
            mask = torch.full((t, t), float("-inf"), device="meta").triu(1)[None, None].expand(b, 1, t, t)
        return self.hf(input_ids=idx.long(), attention_mask=mask, use_cache=False).logits

    def train(self, mode: bool = True) -> CausalLM:
        self.hf.training = mode  # its own flag too: some models branch on it
        return super().train(mode)

    def gradient_checkpointing_enable(self) -> None:
        """Activation checkpointing, the HF model's own (non-reentrant: it works with a
        frozen base, whose inputs need no gradient)."""
        kwargs = {"use_reentrant": False}
        if callable(getattr(self.hf, "activation_checkpointing_enable", None)):  # transformers >= 5.x
            self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def with_lora(self, lora: LoRA) -> CausalLM:
        """This model with ``lora``'s adapters (peft's, ``task_type="CAUSAL_LM"``: so
        ``all-linear`` leaves the output head out), its state the adapters alone."""
        with warnings.catch_warnings():  # peft calls transformers' deprecated names: not the user's to act on
            warnings.simplefilter("ignore", FutureWarning)
            adapted = peft_module().get_peft_model(self.hf, lora.peft_config(causal_lm=True))
        wrapped = CausalLM(adapted)
        wrapped.__dict__["ttpeer_base_bits"] = lora.base_bits
        return cast(CausalLM, freeze_outside_state(wrapped))


def tied_aliases(model: nn.Module) -> frozenset[str]:
    """State-dict names that are a tensor already listed under an earlier name."""
    seen: set[int] = set()
    aliases = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            aliases.add(name)
        seen.add(id(tensor))
    return frozenset(aliases)


def _drop_tied(module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
    for name in getattr(module, "tied", ()):
        state.pop(prefix + name, None)


def _tied_not_missing(module: nn.Module, incompatible: Any) -> None:
    tied = getattr(module, "tied", frozenset())
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in tied]


# -- where the model comes from ---------------------------------------------------------------


def resolve_config(model: str | os.PathLike[str] | Mapping[str, Any] | Any) -> tuple[Any, Path | None]:
    """The model's HF config and its local folder (None for a config). Raises TaskError
    for a path that is not a folder with a config.json, or a config that is not a
    decoder-only causal LM."""
    tf = hf_modules()
    if isinstance(model, str | os.PathLike):
        folder = Path(model).expanduser()
        if not folder.is_dir():
            raise TaskError(f"hf_causal_lm: model {os.fspath(model)!r} is not a local folder; ttpeer downloads "
                            "nothing: save the model with save_pretrained (or huggingface-cli download) on "
                            "every peer and give that folder's path, or pass a config")
        if not (folder / "config.json").is_file():
            found = sorted(p.name for p in folder.iterdir())[:8]
            raise TaskError(f"hf_causal_lm: {folder} has no config.json (found {found or 'nothing'}); give a "
                            "folder written by save_pretrained")
        try:
            config = tf.AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
        except (ValueError, OSError, KeyError) as exc:
            raise TaskError(f"hf_causal_lm: cannot read {folder / 'config.json'}: {exc}") from None
        check_causal(config, str(folder))
        return config, folder.resolve()
    if isinstance(model, Mapping):
        kind = model.get("model_type")
        if not isinstance(kind, str) or kind not in tf.CONFIG_MAPPING:
            raise TaskError(f"hf_causal_lm: a config dict needs a known 'model_type' (e.g. 'gpt2'), got {kind!r}")
        config = tf.CONFIG_MAPPING[kind].from_dict(dict(model))
    elif isinstance(model, tf.PretrainedConfig):
        config = model
    else:
        raise TaskError(f"hf_causal_lm: model must be a local folder, a transformers config or a config dict, "
                        f"got {type(model).__name__}")
    check_causal(config, "the config")
    return config, None


def check_causal(config: Any, where: str) -> None:
    """Refuse what ttpeer cannot train as ``next token given the ones before``."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = getattr(config, "model_type", "?")
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind)
    archs = list(getattr(config, "architectures", None) or [])
    found = f"{where} is a {kind!r} model" + (f" ({', '.join(archs)})" if archs else "")
    if causal is None:
        raise TaskError(f"hf_causal_lm: {found}, which has no causal language-model head in transformers; "
                        "give a decoder-only model such as gpt2, llama, qwen2 or mistral")
    causal_names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    encoder = kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES or getattr(config, "is_encoder_decoder", False)
    if (archs and not any(a in causal_names for a in archs)) or (encoder and not getattr(config, "is_decoder", False)):
        raise TaskError(f"hf_causal_lm: {found}: an encoder (masked or sequence-to-sequence) model, not a "
                        "causal language model; give a decoder-only model such as gpt2, llama, qwen2 or "
                        "mistral")


def builder(config: Any, folder: Path | None, lora: LoRA | None = None) -> Callable[[], CausalLM]:
    """``model()`` for the TaskSpec: random weights from the torch generator (which the
    trainer seeds), or the folder's weights. On the meta device (the fit check) it builds
    from the config: same shapes, no file read. Weights are fp32, except a LoRA task's
    frozen base (``base_dtype``); the adapters themselves are added by ``load_task``
    (``CausalLM.with_lora``). Raises TaskError for a 4-bit base on a peer that cannot
    load one."""

    def build() -> CausalLM:
        tf = hf_modules()
        meta = torch.get_default_device().type == "meta"
        dtype = base_dtype(config, lora)
        if folder is None or meta:
            hf = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
        elif lora is not None and lora.base_bits == 4:
            hf = _load_4bit(tf, folder)
        else:
            hf = tf.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype,
                                                         trust_remote_code=False)
        if lora is not None:
            hf.requires_grad_(False)
        return CausalLM(hf)

    return build


def base_dtype(config: Any, lora: LoRA | None) -> torch.dtype:
    """The dtype the model's weights are built in: fp32 for full fine-tuning (ttpeer's
    master weights); for a frozen LoRA base, the dtype the folder stores (its
    ``config.json``), or fp32 on a peer without CUDA, where bf16 matmuls are slow."""
    if lora is None or not torch.cuda.is_available():
        return torch.float32
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if stored in (torch.bfloat16, torch.float16) else torch.float32


def _load_4bit(tf: Any, folder: Path) -> Any:
    """The folder's model with its linear layers in NF4 (bitsandbytes) on this CUDA device,
    readied by peft for training adapters over it. Raises TaskError where it cannot be."""
    problem = qlora_problem("cuda" if torch.cuda.is_available() else "cpu")
    if problem is not None:
        raise TaskError(f"hf_causal_lm: {problem}")
    compute = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    quant = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute)
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, quantization_config=quant,
                                                 dtype=compute, device_map={"": torch.cuda.current_device()},
                                                 trust_remote_code=False)
    return peft_module().prepare_model_for_kbit_training(hf, use_gradient_checkpointing=False)


def config_json(config: Any) -> str:
    """The config as JSON without the writer's transformers version: what the export needs."""
    data = config.to_dict()
    data.pop("transformers_version", None)
    return json.dumps(data, sort_keys=True, default=str)


def visible_files(folder: Path) -> list[Path]:
    """The files under ``folder``, sorted by relative path, skipping hidden ones (a name
    starting with a dot, e.g. the ``.cache/`` a hub download leaves, with its timestamps)."""
    files = (p for p in folder.rglob("*") if p.is_file()
             and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def folder_hash(folder: Path) -> str:
    """sha256 over the visible files in ``folder`` (names and bytes; symlinks followed)."""
    files = visible_files(folder)
    stamp = tuple((p.as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _hash_files(folder, stamp)


@lru_cache(maxsize=8)
def _hash_files(folder: Path, stamp: tuple[tuple[str, int, int], ...]) -> str:
    # Cached by (path, size, mtime) of each file: peers in one process (tests) and repeated
    # loads of one task (submit, prepare, export) hash a large weights file once.
    digest = hashlib.sha256(b"ttpeer-hf-folder-v1")
    for path, size, _mtime in stamp:
        name = Path(path).relative_to(folder).as_posix().encode()
        digest.update(len(name).to_bytes(4, "little") + name + size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
