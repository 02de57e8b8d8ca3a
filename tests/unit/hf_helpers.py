"""Small Hugging Face things made in a test's tmp_path, offline: text data, a word-level
tokenizer trained on it, a tiny GPT-2 saved with save_pretrained, and task files."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

WORDS = ("the cat sat on a mat and ran to the dog who was by the red door while it rained "
         "in the old town near a river").split()
# A config small enough that a few steps take well under a second on one core.
TINY_GPT2: dict[str, Any] = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64,
                             "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0}


def sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + "." for _ in range(count)]


def text_files(folder: Path, files: int = 3, lines: int = 60, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (folder / f"doc{i}.txt").write_text("\n".join(sentences(lines, seed + i)) + "\n")
    return folder


def jsonl_file(path: Path, rows: int = 150, seed: int = 0) -> Path:
    path.write_text("".join(json.dumps({"id": i, "body": s}) + "\n" for i, s in enumerate(sentences(rows, seed))))
    return path


def parquet_file(path: Path, rows: int = 150, seed: int = 0) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": sentences(rows, seed)}), path)
    return path


def model_folder(folder: Path, *, seed: int = 5) -> Path:
    """A tiny GPT-2 and a word-level tokenizer for WORDS, saved as a Hugging Face folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(sentences(200, 99), trainers.WordLevelTrainer(special_tokens=["[UNK]", "<eos>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="<eos>")
    eos = tokenizer.eos_token_id
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=len(tokenizer),
                        bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def task_file(path: Path, model: Any, data: Any, **settings: Any) -> Path:
    """A task file calling hf_causal_lm with these arguments (paths as strings)."""
    def lit(value: Any) -> str:
        return repr(str(value)) if isinstance(value, Path) else repr(value)

    extra = "".join(f", {k}={lit(v)}" for k, v in settings.items())
    path.write_text("from ttpeer.tasks import hf_causal_lm\n\n\n"
                    "def task():\n"
                    f"    return hf_causal_lm({lit(model)}, data={lit(data)}{extra})\n")
    return path


ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# A chat template of the usual shape: each turn opens with its role's token and ends with <eos>;
# the generation prompt is the assistant's opening token.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def chat_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """Conversations: a user line and the assistant's answer, which repeats the user's
    words reversed (so a model can learn it), some with a system line first."""
    rng = random.Random(seed)
    rows = []
    for i, line in enumerate(sentences(count, seed)):
        words = line.rstrip(".").split()
        messages = [{"role": "system", "content": "reverse the words"}] if rng.random() < 0.3 else []
        messages += [{"role": "user", "content": " ".join(words)},
                     {"role": "assistant", "content": " ".join(reversed(words))}]
        rows.append({"id": i, "messages": messages})
    return rows


def chat_file(path: Path, rows: int = 200, seed: int = 0) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(rows, seed)))
    return path


def llama_folder(folder: Path, *, seed: int = 5, dtype: str = "bfloat16") -> Path:
    """A tiny Llama (random weights, stored at ``dtype``) and a word-level tokenizer for
    WORDS with role tokens and a chat template, saved as a Hugging Face folder: the shape
    of an instruct model's folder, small enough for a few steps a second on one core."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[UNK]", "<eos>", *ROLE_TOKENS]
    raw.train_from_iterator([*sentences(200, 99), "reverse the words"],
                            trainers.WordLevelTrainer(special_tokens=special))
    raw.add_special_tokens(special)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    eos = tokenizer.eos_token_id
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
