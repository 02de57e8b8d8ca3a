"""``ttpeer export JOB OUT --format hf`` (or ``peft``): a finished job's model as a
``save_pretrained`` folder that ``transformers.AutoModelForCausalLM.from_pretrained(OUT)``
loads, or a LoRA job's adapters as one that ``peft.PeftModel.from_pretrained(base, OUT)``
loads (``--format hf --merge``: the adapters merged into the base, a plain HF model).

It needs no task file and no data: the export sidecar's ``task_info`` (written by
``hf_causal_lm``) holds the model's config and where its tokenizer came from. The
weights are ttpeer's fp32 export, loaded strictly into a model built from that config
(so a missing or extra tensor is an error, not a silent random weight); the tokenizer
folder must still hash to what the job trained with. The folder is written under a
temporary name beside OUT and renamed into place, so OUT is never half written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ttpeer.train import CheckpointError, LoRA, peft_module

from ._hf_data import BYTES
from ._hf_model import CausalLM, folder_hash, hf_modules

SIDECAR = "ttpeer.json"


def export_hf(model_file: Path, sidecar: Mapping[str, Any], out: Path, *, fmt: str = "hf",
              merge: bool = False) -> Path:
    """Write the model of ``model_file`` (a ttpeer fused export with its ``sidecar``) to
    the folder ``out``; returns the weights file written there. ``fmt`` ``"peft"``: a
    LoRA job's adapters alone; ``merge``: (``"hf"``) a LoRA job's adapters merged into
    its base, read from the base folder the job trained over.

    Raises CheckpointError if the job's task is not an ``hf_causal_lm`` task or is an
    ensemble, a LoRA job is asked for ``hf`` without ``merge`` (or a full fine-tune for
    ``peft`` or ``merge``), ``out`` exists and is not an empty folder, the model file
    does not match its sidecar or the config, or the tokenizer or base folder is gone or
    changed; OSError if ``out``'s folder is not writable."""
    info = sidecar.get("task_info") or {}
    if info.get("hf") != "causal_lm":
        raise CheckpointError(f"job's task {sidecar.get('task')!r} is not a Hugging Face model: --format {fmt} "
                              "exports tasks built with ttpeer.tasks.hf_causal_lm; drop --format to get the "
                              "safetensors file")
    if sidecar.get("mode") == "ensemble":
        raise CheckpointError(f"--format {fmt} exports one model; this job is an ensemble: drop --format for the "
                              "bundle")
    lora = LoRA.from_key(info["lora"]) if info.get("lora") else None
    if lora is None and (fmt == "peft" or merge):
        raise CheckpointError(f"{'--format peft' if fmt == 'peft' else '--merge'} is for a job that trained LoRA "
                              "adapters; this one trained every parameter: --format hf writes it")
    if lora is not None and fmt == "hf" and not merge:
        raise CheckpointError("this job trained LoRA adapters over a frozen base: --format peft writes the "
                              "adapters (small; peft loads them over the base), --format hf --merge the base with "
                              "them merged in")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty folder; give a new folder for the export")
    data = model_file.read_bytes()
    if hashlib.sha256(data).hexdigest() != sidecar.get("model_sha256"):
        raise CheckpointError(f"{model_file} does not hash to the model_sha256 its sidecar records")
    tf = hf_modules()
    hf = _model(tf, info["hf_config"], data) if lora is None else _adapted(tf, info, lora, data, merge=merge)
    tokenizer = _tokenizer(tf, info)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        hf.save_pretrained(staging, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        (staging / SIDECAR).write_text(json.dumps(dict(sidecar), indent=2, sort_keys=True) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    weights = sorted(out.glob("*.safetensors"))
    return weights[0] if len(weights) == 1 else out


def _model(tf: Any, config_text: str, data: bytes) -> Any:
    from safetensors.torch import load as safetensors_load

    settings = json.loads(config_text)
    config = tf.CONFIG_MAPPING[settings["model_type"]].from_dict(settings)
    hf = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    wrapped = CausalLM(hf)  # ttpeer's names: the HF names without tied aliases
    try:
        wrapped.load_state_dict(safetensors_load(data), strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"the exported weights do not fit the job's {settings['model_type']} config: "
                              f"{str(exc).splitlines()[0]}") from None
    return hf


def _adapted(tf: Any, info: Mapping[str, str], lora: LoRA, data: bytes, *, merge: bool) -> Any:
    """The job's PeftModel holding the exported adapters: over a base on the meta device
    (its weights are not written) for ``peft``, or over the real base, merged, for ``merge``."""
    from safetensors.torch import load as safetensors_load

    settings = json.loads(info["hf_config"])
    if merge:
        base = _base(tf, info, "to merge, or export the adapters with --format peft")
    else:
        with torch.device("meta"):
            config = tf.CONFIG_MAPPING[settings["model_type"]].from_dict(settings)
            base = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    wrapped = CausalLM(base).with_lora(lora)
    try:
        wrapped.load_state_dict(safetensors_load(data), strict=True, assign=not merge)
    except RuntimeError as exc:
        raise CheckpointError(f"the exported adapters do not fit the job's {settings['model_type']} config: "
                              f"{str(exc).splitlines()[0]}") from None
    peft_model = wrapped.hf
    if merge:
        return peft_model.merge_and_unload()
    peft_model.peft_config["default"].base_model_name_or_path = str(info.get("hf_model_folder") or "")
    return peft_model


def _base(tf: Any, info: Mapping[str, str], then: str) -> Any:
    """The base model folder a LoRA job trained over, fp32, checked to hash as it did.
    Raises CheckpointError (``then``: what to do once it is back) when gone or changed."""
    folder = Path(info.get("hf_model_folder") or "")
    if not folder.is_dir() or folder_hash(folder) != info.get("hf_model_sha256"):
        raise CheckpointError(f"the base model folder {folder} the job trained over is gone or changed; put it "
                              f"back at that path {then}")
    return tf.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32,
                                                   trust_remote_code=False)


def _tokenizer(tf: Any, info: Mapping[str, str]) -> Any | None:
    where = info.get("hf_tokenizer", BYTES)
    if where == BYTES:
        return None  # byte-level: ids are UTF-8 bytes, there is no tokenizer to save
    folder = Path(where)
    if not folder.is_dir():
        raise CheckpointError(f"the job's tokenizer folder {folder} is gone; put it back at that path to export "
                              "it with the model, or drop --format to get the weights alone")
    if folder_hash(folder) != info.get("hf_tokenizer_sha256"):
        raise CheckpointError(f"the tokenizer folder {folder} changed since the job trained; restore it to export "
                              "the tokenizer the model learned")
    return tf.AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)


def load_folder(folder: Path) -> CausalLM:
    """A folder ``export --format hf`` (or ``peft``) wrote, as ttpeer's model of it (token
    ids -> logits), in eval mode: the saved model, or the base folder the job trained
    over with the adapters on it (that folder must hash as it did). Raises
    CheckpointError for a folder without ttpeer's sidecar, or a base gone or changed."""
    sidecar = folder / SIDECAR
    if not sidecar.is_file():
        raise CheckpointError(f"{folder} has no {SIDECAR}: give a folder 'ttpeer export --format hf' or "
                              "'--format peft' wrote")
    info = json.loads(sidecar.read_text()).get("task_info") or {}
    tf = hf_modules()
    if not (folder / "adapter_config.json").is_file():
        hf = tf.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32,
                                                     trust_remote_code=False)
        return CausalLM(hf).eval()
    hf = _base(tf, info, "to load these adapters")
    with warnings.catch_warnings():  # peft calls transformers' deprecated names: not the user's to act on
        warnings.simplefilter("ignore", FutureWarning)
        adapted = peft_module().PeftModel.from_pretrained(hf, folder)
    return CausalLM(adapted).eval()
