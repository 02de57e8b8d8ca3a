"""``ttpeer export JOB OUT --format hf``: a finished job's model as a ``save_pretrained``
folder that ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads.

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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ttpeer.train import CheckpointError

from ._hf_data import BYTES
from ._hf_model import CausalLM, folder_hash, hf_modules

SIDECAR = "ttpeer.json"


def export_hf(model_file: Path, sidecar: Mapping[str, Any], out: Path) -> Path:
    """Write the model of ``model_file`` (a ttpeer fused export with its ``sidecar``) to
    the folder ``out``; returns the weights file written there.

    Raises CheckpointError if the job's task is not an ``hf_causal_lm`` task or is an
    ensemble, ``out`` exists and is not an empty folder, the model file does not match
    its sidecar or the config, or the tokenizer folder is gone or changed; OSError if
    ``out``'s folder is not writable."""
    info = sidecar.get("task_info") or {}
    if info.get("hf") != "causal_lm":
        raise CheckpointError(f"job's task {sidecar.get('task')!r} is not a Hugging Face model: --format hf "
                              "exports tasks built with ttpeer.tasks.hf_causal_lm; drop --format to get the "
                              "safetensors file")
    if sidecar.get("mode") == "ensemble":
        raise CheckpointError("--format hf exports one model; this job is an ensemble: drop --format for the bundle")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty folder; give a new folder for the export")
    data = model_file.read_bytes()
    if hashlib.sha256(data).hexdigest() != sidecar.get("model_sha256"):
        raise CheckpointError(f"{model_file} does not hash to the model_sha256 its sidecar records")
    tf = hf_modules()
    hf = _model(tf, info["hf_config"], data)
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
