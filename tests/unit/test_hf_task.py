"""``ttpeer.tasks.hf_causal_lm``: a transformers causal LM from a config or a local folder,
local data through ``datasets``, the task hash, the checks, and ``export --format hf``.
Everything is made in tmp_path; nothing is downloaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

torch.set_num_threads(1)  # two cores shared with other work: threads only contend
pytest.importorskip("transformers", reason="the Hugging Face extra: pip install 'ttpeer[hf]'")

from ttpeer import train  # noqa: E402
from ttpeer.tasks._hf_export import export_hf  # noqa: E402

from .hf_helpers import TINY_GPT2, jsonl_file, model_folder, parquet_file, task_file, text_files  # noqa: E402


def _load(path: Path, tmp_path: Path) -> train.LoadedTask:
    return train.load_task(path, tmp_path / "cache")


@pytest.mark.slow
def test_a_config_model_on_text_files_trains_and_its_loss_falls(tmp_path):
    data = text_files(tmp_path / "data")
    task = _load(task_file(tmp_path / "t.py", TINY_GPT2, data, block_size=32), tmp_path)
    assert task.metric_name == "perplexity" and task.n_train > 50 and task.n_test > 5
    assert task.spec.info["hf_tokenizer"] == "bytes" and task.spec.info["hf_model_folder"] == ""
    # Random weights come from the generator the trainer seeds: same seed, same state.
    first, again, other = (train.init_state(task, s) for s in (1, 1, 2))
    assert train.state_hash(first) == train.state_hash(again) != train.state_hash(other)
    # The HF names, with GPT-2's tied head stored once (it is the token embedding).
    from transformers import AutoModelForCausalLM, GPT2Config

    names = {n for n, _ in AutoModelForCausalLM.from_config(GPT2Config(**TINY_GPT2)).named_parameters()}
    assert set(first.params) == names and "lm_head.weight" not in first.params
    trainer = train.InnerTrainer(task, lr=3e-3, seed=1)
    trainer.start(first)
    before, _ = trainer.evaluate(first.params)
    trainer.train_shard(train.shard_indices(task.n_train, 0, 0, 0, 1, 30, 16))
    local = {k: first.params[k] - v for k, v in trainer.delta(first).items()}
    after, ppl = trainer.evaluate(local)
    assert after < before - 1.0, (before, after)  # bytes of a 30-word language: 5.5 nats falls fast
    assert ppl == pytest.approx(torch.tensor(after).exp().item(), rel=1e-4)
    # The fit check measures this model's activations (meta device), not a stand-in.
    need = train.memory_need(task, batch_size=16, shards=2)
    assert need.activations > 16 * 32 * 256 * 4  # at least the logits


def test_a_folder_model_starts_from_its_weights_and_uses_its_tokenizer(tmp_path):
    folder = model_folder(tmp_path / "gpt")
    task = _load(task_file(tmp_path / "t.py", folder, parquet_file(tmp_path / "d.parquet"), block_size=16), tmp_path)
    assert task.spec.info["hf_tokenizer"] == str(folder.resolve())
    from safetensors.torch import load_file

    saved = load_file(folder / "model.safetensors")
    state = train.init_state(task, 123)  # the seed does not matter: the folder's weights are the start
    assert set(state.params) <= set(saved) and state.params
    assert all(torch.equal(state.params[k], saved[k].float()) for k in state.params)
    x, y = task.train[0]
    assert x.shape == (16,) and int(x.max()) < 40  # word ids of the folder's tokenizer, not bytes
    assert torch.equal(x[1:], y[:-1])
    # JSON lines with another column name.
    jt = _load(task_file(tmp_path / "j.py", folder, jsonl_file(tmp_path / "d.jsonl"), block_size=16,
                         text_field="body"), tmp_path)
    assert jt.n_train > 10


def test_the_data_the_tokenizer_and_the_model_files_are_part_of_the_task_hash(tmp_path):
    data = text_files(tmp_path / "data")
    path = task_file(tmp_path / "t.py", TINY_GPT2, data, block_size=32)
    first = _load(path, tmp_path).source_hash
    assert _load(path, tmp_path).source_hash == first
    (data / "doc1.txt").write_text((data / "doc1.txt").read_text().replace("cat", "cow", 1))
    changed = _load(path, tmp_path).source_hash
    assert changed != first
    folder = model_folder(tmp_path / "gpt")
    fpath = task_file(tmp_path / "f.py", folder, data, block_size=16)
    before = _load(fpath, tmp_path).source_hash
    (folder / ".cache").mkdir()  # what a hub download leaves, with its own timestamps: not the model
    (folder / ".cache" / "download.lock").write_text("1796116921")
    assert _load(fpath, tmp_path).source_hash == before
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "resid_pdrop": 0.2}))
    assert _load(fpath, tmp_path).source_hash != before


@pytest.mark.parametrize("case, expect", [
    ("bert", "'bert' model (BertForMaskedLM)"),
    ("bert-config", "'bert' model"),
    ("t5", "'t5' model"),
    ("no-config", "has no config.json"),
    ("hub-name", "is not a local folder; ttpeer downloads nothing"),
    ("missing-data", "does not exist on this machine; every peer needs the same files at the same path, or add "
                     "them to the pool once ('ttpeer data add PATH --name NAME' where they are) and give "
                     "data=dataset_path(NAME)"),
    ("mixed", "mixes formats"),
    ("column", "no column 'text' (found ['id', 'body'])"),
    ("short", "needs at least"),
    ("vocab", "needs vocab_size >= 256"),
    ("positions", "longer than the model's 64 positions"),
])
def test_bad_input_gets_one_clear_error(tmp_path, case, expect):
    from transformers import BertConfig, BertForMaskedLM

    data = text_files(tmp_path / "data", files=1)
    model, settings = TINY_GPT2, {"block_size": 32}
    if case == "bert":
        model = tmp_path / "bert"
        BertForMaskedLM(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                   intermediate_size=64, vocab_size=300)).save_pretrained(model)
    elif case == "bert-config":
        model = {"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2}
    elif case == "t5":
        model = {"model_type": "t5", "num_layers": 1, "d_model": 32}
    elif case == "no-config":
        model = tmp_path / "empty"
        model.mkdir()
        (model / "weights.bin").write_bytes(b"x")
    elif case == "hub-name":
        model = "openai-community/gpt2"
    elif case == "missing-data":
        data = tmp_path / "nope.txt"
    elif case == "mixed":
        jsonl_file(data / "more.jsonl")
    elif case == "column":
        data = jsonl_file(tmp_path / "d.jsonl")
    elif case == "short":
        data = tmp_path / "tiny.txt"
        data.write_text("a short text.")
    elif case == "vocab":
        model = {**TINY_GPT2, "vocab_size": 100}
    elif case == "positions":
        settings = {"block_size": 65}
    with pytest.raises(train.TaskError) as caught:
        _load(task_file(tmp_path / "t.py", model, data, **settings), tmp_path)
    assert expect in str(caught.value)
    assert "\n" not in str(caught.value).split(": ", 1)[1]


def _trained_export(tmp_path: Path, folder: Path | None) -> tuple[train.LoadedTask, Path]:
    data = text_files(tmp_path / "data")
    model = folder if folder is not None else TINY_GPT2
    task = _load(task_file(tmp_path / "t.py", model, data, block_size=16), tmp_path)
    state = train.init_state(task, 7)
    trainer = train.InnerTrainer(task, lr=3e-3, seed=7)
    trainer.start(state)
    trainer.train_shard(train.shard_indices(task.n_train, 0, 0, 0, 1, 5, 8))
    delta = trainer.delta(state)
    trained = train.OuterState({k: state.params[k] - delta[k] for k in state.params}, state.momentum)
    out = tmp_path / "final.safetensors"
    train.export_model(trained, task, out, {"rounds": 1})
    return task, out


@pytest.mark.slow
@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_export_hf_loads_back_in_transformers_with_identical_weights(tmp_path, with_tokenizer):
    folder = model_folder(tmp_path / "gpt") if with_tokenizer else None
    task, out = _trained_export(tmp_path, folder)
    sidecar = json.loads(out.with_suffix(".json").read_text())
    weights = export_hf(out, sidecar, tmp_path / "hf")
    assert weights.name == "model.safetensors"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    ours = load_file(out)
    state = loaded.state_dict()
    assert len(ours) == len(train.init_state(task, 0).params)
    assert all(torch.equal(state[k], v) for k, v in ours.items())
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again, as GPT-2 is
    x = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        theirs = loaded(input_ids=x).logits
        mine = train.load_model(out, task)(x)
    assert torch.equal(mine, theirs)
    if with_tokenizer:
        assert AutoTokenizer.from_pretrained(tmp_path / "hf").tokenize("the cat sat") == ["the", "cat", "sat"]
    else:
        assert not (tmp_path / "hf" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "hf" / "ttpeer.json").read_text())["model_sha256"] == sidecar["model_sha256"]


@pytest.mark.slow
def test_export_hf_refuses_what_it_cannot_write(tmp_path):
    task, out = _trained_export(tmp_path, None)
    sidecar = json.loads(out.with_suffix(".json").read_text())
    with pytest.raises(train.CheckpointError, match="is not a Hugging Face model: --format hf exports tasks"):
        export_hf(out, {**sidecar, "task": "mnist1d", "task_info": {}}, tmp_path / "a")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("mine")
    with pytest.raises(train.CheckpointError, match="exists and is not an empty folder"):
        export_hf(out, sidecar, busy)
    assert (busy / "x").read_text() == "mine"
    with pytest.raises(train.CheckpointError, match="does not hash to the model_sha256"):
        export_hf(out, {**sidecar, "model_sha256": "0" * 64}, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_the_public_surface_is_one_helper_and_its_adapters_importing_transformers_only_when_called():
    import ttpeer.tasks

    assert ttpeer.tasks.__all__ == ["LoRA", "hf_causal_lm"]
    code = ("import sys, ttpeer.tasks; "
            "print(sorted(m for m in ('transformers', 'datasets', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split()[-1] == "[]"


@pytest.mark.slow
def test_export_format_hf_of_another_task_is_one_clear_line_and_writes_nothing(tmp_path, capsys):
    from ttpeer.cli import main

    _task, out = _trained_export(tmp_path, None)
    folder = tmp_path / "home" / "states" / "abc123"
    folder.mkdir(parents=True)
    (folder / "final.safetensors").write_bytes(out.read_bytes())
    sidecar = json.loads(out.with_suffix(".json").read_text())
    (folder / "final.json").write_text(json.dumps({**sidecar, "task": "mnist1d", "task_info": {}}))
    (folder / "done.json").write_text("{}")
    target = tmp_path / "hf"
    assert main(["export", "abc123", str(target), "--format", "hf", "--home", str(tmp_path / "home")]) == 1
    err = capsys.readouterr().err.strip()
    assert "'mnist1d' is not a Hugging Face model" in err and "\n" not in err and not target.exists()


def test_source_files_are_text_when_named_and_in_a_folder_with_extensions(tmp_path):
    from ttpeer.tasks import hf_causal_lm

    code = tmp_path / "src"
    code.mkdir()
    (code / "a.py").write_text("def main():\n    return 42\n" * 40)
    (code / "b.rs").write_text("fn main() { println!(\"hi\"); }\n" * 40)
    (code / "notes.bin").write_bytes(b"\0\1")
    config = {"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 64,
              "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0}
    named = hf_causal_lm(config, data=[code / "a.py", code / "b.rs"], block_size=16, tokenizer="bytes")
    assert named.info["data_files"] == "2"
    with pytest.raises(train.TaskError, match=r"no data files .* pass extensions=\['.py', ...\]"):
        hf_causal_lm(config, data=code, block_size=16, tokenizer="bytes")
    folder = hf_causal_lm(config, data=code, block_size=16, tokenizer="bytes", extensions=[".py", "rs"])
    assert folder.info["data_files"] == "2" and folder.data_hash == named.data_hash  # the same files, the same task
    only_py = hf_causal_lm(config, data=code, block_size=16, tokenizer="bytes", extensions=[".py"])
    assert only_py.info["data_files"] == "1" and only_py.data_hash != named.data_hash
    with pytest.raises(train.TaskError, match="extensions must be a list of file suffixes"):
        hf_causal_lm(config, data=code, block_size=16, tokenizer="bytes", extensions=".py")
