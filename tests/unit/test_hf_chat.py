"""Chat and instruction rows for ``hf_causal_lm`` (``ttpeer/tasks/_hf_chat.py``): JSON lines
of ``messages`` (the loss on the assistant's tokens only) or ``prompt``/``completion`` (the
loss on the completion), the targets the loss does not count (-100), the errors that name
``file:line``, and ``lm_loss`` over such targets. Plain text and ``text`` rows stay as they
were. Everything is made in tmp_path; nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(1)  # two cores shared with other work: threads only contend

pytest.importorskip("transformers", reason="the Hugging Face extra: pip install 'ttpeer[hf]'")

from ttpeer.tasks import hf_causal_lm  # noqa: E402
from ttpeer.tasks._hf import lm_loss, perplexity  # noqa: E402
from ttpeer.train import TaskError  # noqa: E402

from .hf_helpers import TINY_GPT2, chat_rows, llama_folder, model_folder, sentences, text_files  # noqa: E402

IGNORE = -100
SYSTEM = {"role": "system", "content": "reverse the words"}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder whose word-level tokenizer has a chat template."""
    return llama_folder(tmp_path_factory.mktemp("chat") / "base")


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _windows(spec: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The training windows' inputs and targets, each as one stream."""
    x, y = spec.train
    return x.flatten().long(), y.flatten().long()


def _rendered(tokenizer: Any, rows: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """The ids of ``rows`` rendered whole with the chat template, and which the loss should
    count: what follows an ``<|assistant|>`` token up to its turn's ``<eos>``, inclusive."""
    ids: list[int] = []
    counted: list[int] = []
    opening, eos = tokenizer.convert_tokens_to_ids("<|assistant|>"), tokenizer.eos_token_id
    for row in rows:
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        answering = False
        for i in tokenizer(text, add_special_tokens=False)["input_ids"]:
            ids.append(i)
            counted.append(int(answering))
            answering = (answering and i != eos) or i == opening
    return ids, counted


def _chats(count: int) -> list[dict[str, Any]]:
    """A system row, a two-turn row, then generated conversations (some with a system line)."""
    two_turns = [{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": "sat cat the"},
                 {"role": "user", "content": "a red door"}, {"role": "assistant", "content": "door red a"}]
    first = [SYSTEM, {"role": "user", "content": "the dog ran"}, {"role": "assistant", "content": "ran dog the"}]
    return [{"messages": first}, {"messages": two_turns}, *chat_rows(count, 3)]


# -- messages ------------------------------------------------------------------------------------


def test_a_conversation_counts_the_assistants_tokens_only(tmp_path, chat_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    rows = _chats(60)
    spec = hf_causal_lm(chat_model, data=_jsonl(tmp_path / "chats.jsonl", rows), block_size=16)
    x, y = _windows(spec)
    ids, counted = _rendered(tokenizer, rows)
    n = len(x)
    want = [i if c else IGNORE for i, c in zip(ids[1:n + 1], counted[1:n + 1], strict=True)]
    assert y.tolist() == want
    # Read back: the first row's counted targets are its answer and the turn's end; the
    # two-turn row's both answers, and neither user line.
    runs = " ".join(tokenizer.convert_ids_to_tokens([t for t in y.tolist() if t != IGNORE])).split(" <eos>")
    assert [r.strip() for r in runs[:3]] == ["ran dog the", "sat cat the", "door red a"]
    # The system line is read (in the inputs), never a target.
    system_ids = set(tokenizer("<|system|> reverse", add_special_tokens=False)["input_ids"])
    assert system_ids <= set(x.tolist()) and not system_ids & set(y.tolist())
    assert spec.info["rows"] == "messages" and int(spec.info["trained_tokens"]) == sum(counted)
    # The validation windows are cut the same way: a counted target is the next input.
    vx, vy = spec.test
    kept = vy[:, :-1] != IGNORE
    assert kept.any() and (vy == IGNORE).any()
    assert torch.equal(vy[:, :-1][kept].long(), vx[:, 1:][kept].long())


def test_conversations_are_packed_back_to_back_into_windows_that_cut_across_rows(tmp_path, chat_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    rows = _chats(60)
    spec = hf_causal_lm(chat_model, data=_jsonl(tmp_path / "chats.jsonl", rows), block_size=8)
    windows, _ = spec.train
    ids, _counted = _rendered(tokenizer, rows)
    assert windows.flatten().tolist() == ids[:windows.numel()]  # no padding, no row dropped
    first_row = len(tokenizer(tokenizer.apply_chat_template(rows[0]["messages"], tokenize=False),
                              add_special_tokens=False)["input_ids"])
    assert first_row == 15  # the first conversation spans two windows...
    user = tokenizer.convert_tokens_to_ids("<|user|>")
    assert windows[1].tolist().index(user) == 7  # ...and the second begins in the last place of the second


def test_a_prompt_and_completion_count_the_completion_and_its_end_of_text(tmp_path):
    words = sentences(80, 4)
    rows = [{"prompt": f"Q: {s}\nA:", "completion": f" {s.split()[0]}"} for s in words]
    spec = hf_causal_lm(TINY_GPT2, data=_jsonl(tmp_path / "pairs.jsonl", rows), block_size=32, tokenizer="bytes")
    x, y = _windows(spec)
    stream = b"".join(f"{r['prompt']}{r['completion']}\0".encode() for r in rows)
    counted = b"".join(bytes(len(r["prompt"].encode())) + b"\1" * (len(r["completion"].encode()) + 1) for r in rows)
    n = len(x)
    assert x.tolist() == list(stream[:n])
    assert y.tolist() == [b if c else IGNORE for b, c in zip(stream[1:n + 1], counted[1:n + 1], strict=True)]
    first = len(rows[0]["prompt"])
    assert y[first - 1:first + len(rows[0]["completion"])].tolist() == list(f"{rows[0]['completion']}\0".encode())
    assert (y[:first - 1] == IGNORE).all()  # the prompt is read, not learnt
    assert spec.info["rows"] == "prompt/completion"


# -- errors name the file and line -------------------------------------------------------------------


GOOD = {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "cat the"}]}


@pytest.mark.parametrize("lines, line, expect", [
    ([GOOD, GOOD, {"id": 2, "text_": "the cat"}], 3,
     "the data's rows are conversations (as its first row), and this one has no 'messages' list"),
    ([GOOD, {"messages": [{"role": "robot", "content": "hi"}, GOOD["messages"][1]]}], 2,
     "message 0 must be {'role': one of ['system', 'user', 'assistant', 'tool'], 'content': text}"),
    ([GOOD, {"messages": [{"role": "user"}, GOOD["messages"][1]]}], 2, "message 0 must be {'role'"),
    ([GOOD, {"messages": [SYSTEM, {"role": "user", "content": "the cat"}]}], 2,
     "the conversation has no assistant message, so nothing in it is trained on"),
    ([GOOD, "{not json"], 2, "not a JSON object"),
    ([GOOD, "", ["a", "list"]], 3, "a row must be a JSON object, got list"),  # blank lines count
    ([{"prompt": "a", "completion": "b"}, {"prompt": "a"}], 2,
     "the data's rows are prompt/completion pairs (as its first row), and this one has no text 'completion'"),
])
def test_a_bad_row_is_one_error_naming_its_file_and_line(tmp_path, chat_model, lines, line, expect):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with pytest.raises(TaskError) as caught:
        hf_causal_lm(chat_model, data=path, block_size=4)
    message = str(caught.value)
    assert message.startswith(f"hf_causal_lm: {path.resolve()}:{line}: ") and expect in message, message
    assert "\n" not in message


@pytest.mark.parametrize("tokenizer", ["folder", "bytes"])
def test_conversations_without_a_chat_template_say_which_tokenizer_to_give(tmp_path, tokenizer):
    folder = model_folder(tmp_path / "gpt")  # a tokenizer without a chat template
    path = _jsonl(tmp_path / "chats.jsonl", [GOOD] * 20)
    with pytest.raises(TaskError) as caught:
        hf_causal_lm(folder, data=path, block_size=4, **({"tokenizer": "bytes"} if tokenizer == "bytes" else {}))
    message = str(caught.value)
    assert message.startswith(f"hf_causal_lm: {path.resolve()}:1: conversations ('messages') are rendered with "
                              "the tokenizer's chat template, and this tokenizer has none")
    assert "or use prompt/completion rows" in message and "\n" not in message


# -- the loss --------------------------------------------------------------------------------------------


def test_lm_loss_is_the_mean_over_the_counted_targets_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11, requires_grad=True)
    target = torch.randint(0, 11, (2, 6))
    target[0, :4] = IGNORE
    target[1, 2] = IGNORE
    keep = target != IGNORE
    loss = lm_loss(logits, target)
    assert loss.item() == pytest.approx(F.cross_entropy(logits[keep], target[keep]).item(), rel=1e-6)
    loss.backward()
    assert not logits.grad[~keep].any() and logits.grad[keep].abs().sum() > 0
    # An ignored target is not a token the model got wrong: whatever the logits there, the same loss.
    shifted = logits.detach().clone()
    shifted[~keep] += 100.0
    assert lm_loss(shifted, target).item() == pytest.approx(loss.item(), rel=1e-6)


def test_a_batch_with_no_counted_target_has_loss_zero_and_no_gradient():
    logits = torch.randn(2, 5, 7, requires_grad=True)
    target = torch.full((2, 5), IGNORE)
    loss = lm_loss(logits, target)
    assert loss.item() == 0.0 and loss.dim() == 0
    loss.backward()
    assert logits.grad is not None and not logits.grad.any()  # zeros, not NaN
    assert perplexity(logits.detach(), target) == 1.0


# -- text is as before -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["text files", "json lines of text"])
def test_text_data_has_no_target_left_out(tmp_path, kind):
    if kind == "text files":
        data = text_files(tmp_path / "data")
    else:
        data = _jsonl(tmp_path / "docs.jsonl", [{"text": s, "messages": "not read"} for s in sentences(150, 1)])
    spec = hf_causal_lm(TINY_GPT2, data=data, block_size=32, tokenizer="bytes")
    for x, y in (spec.train, spec.test):
        assert (y >= 0).all() and torch.equal(x[:, 1:], y[:, :-1])
    assert "rows" not in spec.info and "trained_tokens" not in spec.info


def test_the_same_tokens_as_chat_rows_and_as_text_are_different_tasks(tmp_path):
    rows = [{"prompt": f"{s} ->", "completion": f" {s.split()[-1]}"} for s in sentences(80, 2)]
    pairs = hf_causal_lm(TINY_GPT2, data=_jsonl(tmp_path / "pairs.jsonl", rows), block_size=32, tokenizer="bytes")
    text = hf_causal_lm(TINY_GPT2, data=_jsonl(tmp_path / "text.jsonl",
                                               [{"text": r["prompt"] + r["completion"]} for r in rows]),
                        block_size=32, tokenizer="bytes")
    assert torch.equal(pairs.train[0], text.train[0])  # the very same token stream...
    assert not torch.equal(pairs.train[1], text.train[1])  # ...learnt on other targets
    assert pairs.data_hash != text.data_hash

