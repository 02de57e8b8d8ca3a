"""Task helpers for task files: build a ``TaskSpec`` from a model family in one call.

``hf_causal_lm(model=..., data=..., block_size=...)``: a Hugging Face ``transformers``
causal LM (a local folder, or a config for random weights) trained on local text,
JSON lines or parquet files. It needs the optional extra (``pip install
'ttpeer[hf]'``) and imports ``transformers`` and ``datasets`` only when called.
``hf_causal_lm(..., lora=LoRA(r=16))`` trains adapters over the frozen model instead.
"""

from ttpeer.train import LoRA

from ._hf import hf_causal_lm

__all__ = ["LoRA", "hf_causal_lm"]
