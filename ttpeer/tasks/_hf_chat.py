"""Chat and instruction data for ``hf_causal_lm``: JSON lines whose rows are conversations
(``messages``: a list of ``{"role", "content"}``, the format chat datasets use) or
``prompt``/``completion`` pairs, turned into token ids and a mask of the ids the loss counts.

- ``messages``: rendered with the tokenizer's chat template. The loss counts the tokens
  of the assistant's turns only (what the template adds for each assistant message after
  the generation prompt), so the model learns to answer, not to write the user's lines.
- ``prompt``/``completion``: the prompt's tokens, then the completion's and the
  end-of-text id; the loss counts the completion and the end-of-text id.

Each conversation is tokenized turn by turn, so the mask is exact whatever the tokenizer.
Rows are read here line by line (not through ``datasets``), so a bad row is named by its
file and line. A row longer than a training window is not cut: the stream is packed into
windows as plain text is, and a conversation spans as many windows as it needs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ttpeer.train import TaskError

CHAT, PAIRS = "messages", "prompt/completion"
ROLES = ("system", "user", "assistant", "tool")


def row_kind(files: Sequence[Path], text_field: str) -> str | None:
    """``CHAT`` or ``PAIRS`` when the first row of ``files`` (JSON lines) has no
    ``text_field`` but has ``messages``, or ``prompt`` and ``completion``; None for text."""
    first = _first_row(files[0])
    if not isinstance(first, dict) or text_field in first:
        return None
    if "messages" in first:
        return CHAT
    if "prompt" in first and "completion" in first:
        return PAIRS
    return None


def _first_row(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    return json.loads(line)
                except ValueError as exc:
                    raise TaskError(f"hf_causal_lm: {path}:{number}: not a JSON object: {exc}") from None
    return None


def rows(files: Sequence[Path], kind: str) -> list[tuple[str, Any]]:
    """Every row of ``files`` with where it is (``file:line``), each checked against
    ``kind``. Raises TaskError naming the file and line of the first bad one."""
    found = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise TaskError(f"hf_causal_lm: {where}: not a JSON object: {exc}") from None
                found.append((where, _checked(row, kind, where)))
    return found


def _checked(row: Any, kind: str, where: str) -> Any:
    if not isinstance(row, dict):
        raise TaskError(f"hf_causal_lm: {where}: a row must be a JSON object, got {type(row).__name__}")
    if kind == PAIRS:
        for field in ("prompt", "completion"):
            if not isinstance(row.get(field), str):
                raise TaskError(f"hf_causal_lm: {where}: the data's rows are prompt/completion pairs (as its "
                                f"first row), and this one has no text {field!r}")
        return row["prompt"], row["completion"]
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TaskError(f"hf_causal_lm: {where}: the data's rows are conversations (as its first row), and this "
                        "one has no 'messages' list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise TaskError(f"hf_causal_lm: {where}: message {i} must be {{'role': one of {list(ROLES)}, "
                            f"'content': text}}, got {json.dumps(m)[:80]}")
    if not any(m["role"] == "assistant" for m in messages):
        raise TaskError(f"hf_causal_lm: {where}: the conversation has no assistant message, so nothing in it "
                        "is trained on; drop the row or add the answer")
    return messages


def tokenize_rows(found: list[tuple[str, Any]], kind: str, tokenizer: Any | None, eot: int | None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The ids of every row, one after another, and the mask (1: the loss counts the id).
    Raises TaskError for a conversation without a tokenizer that has a chat template."""
    ids: list[int] = []
    mask: list[int] = []
    for where, row in found:
        for text, counted in (_pair(row, eot) if kind == PAIRS else _turns(row, tokenizer, where)):
            piece = _encode(text, tokenizer) if isinstance(text, str) else text
            ids.extend(piece)
            mask.extend([counted] * len(piece))
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)


def _pair(row: tuple[str, str], eot: int | None) -> list[tuple[str | list[int], int]]:
    prompt, completion = row
    return [(prompt, 0), (completion, 1), ([eot] if eot is not None else [], 1)]


def _turns(messages: list[dict[str, str]], tokenizer: Any | None, where: str) -> list[tuple[str, int]]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise TaskError(f"hf_causal_lm: {where}: conversations ('messages') are rendered with the tokenizer's "
                        "chat template, and this tokenizer has none; give a tokenizer folder whose "
                        "tokenizer_config.json has a chat_template (an instruct model's), or use "
                        "prompt/completion rows")

    def render(upto: int, prompt: bool) -> str:
        return str(tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=prompt))

    parts: list[tuple[str, int]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        asked, answered = render(i, True), render(i + 1, False)
        if not asked.startswith(done) or not answered.startswith(asked):
            raise TaskError(f"hf_causal_lm: {where}: the tokenizer's chat template does not render this "
                            "conversation turn by turn (an earlier turn's text changes when later ones are "
                            "added), so the assistant's tokens cannot be told apart")
        parts += [(asked[len(done):], 0), (answered[len(asked):], 1)]
        done = answered
    rest = render(len(messages), False)[len(done):]
    return parts + ([(rest, 0)] if rest else [])


def _encode(text: str, tokenizer: Any | None) -> list[int]:
    if tokenizer is None:
        return list(text.encode("utf-8"))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
