"""LoRA adapters over a frozen base (``ttpeer.train.LoRA``, ``TaskSpec.lora``,
``hf_causal_lm(lora=...)``): the settings and their checks, the adapters alone as the
job's state, the task's hash, the evaluation model that shares the base, the fit
check that counts the base, and the peft export. Everything is made in tmp_path;
nothing is downloaded."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # two cores shared with other work: threads only contend

pytest.importorskip("peft", reason="the Hugging Face extra: pip install 'ttpeer[hf]'")

from ttpeer import train  # noqa: E402
from ttpeer.tasks._hf_export import export_hf  # noqa: E402
from ttpeer.train import LoRA, TaskError  # noqa: E402

from .hf_helpers import TINY_GPT2, chat_file, llama_folder, task_file  # noqa: E402

HF_TASK = """from ttpeer.tasks import LoRA, hf_causal_lm


def task():
    return hf_causal_lm({base!r}, data={data!r}, block_size=32, batch_size=8, lora={lora})
"""
# One file for every LoRA setting: the settings come from a JSON file beside it, so two
# tasks differ by their LoRA alone (the file's own hash is the same).
SETTINGS_TASK = """import json
from pathlib import Path

from ttpeer.tasks import LoRA, hf_causal_lm


def task():
    settings = json.loads(Path({settings!r}).read_text())
    return hf_causal_lm({base!r}, data={data!r}, tokenizer={tok!r}, block_size=32,
                        lora=settings and LoRA(**settings))
"""
MLP_TASK = """import torch
from torch import nn

from ttpeer.train import LoRA, TaskSpec


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def task():
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] * x[:, 1] > 0).long()
    return TaskSpec(model=MLP, train=(x[:448], y[:448]), test=(x[448:], y[448:]),
                    loss=nn.functional.cross_entropy,
                    metric=lambda out, target: (out.argmax(1) == target).float().mean().item(),
                    batch_size=32, lora={lora})
"""
SMALL = "LoRA(r=4, alpha=8, dropout=0.0)"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama folder (bf16, with a chat template) and chat rows, shared by the module."""
    root = tmp_path_factory.mktemp("lora")
    return llama_folder(root / "base"), chat_file(root / "chats.jsonl", rows=120)


def _hf_task(tmp_path: Path, files: tuple[Path, Path], lora: str = SMALL, name: str = "t.py") -> train.LoadedTask:
    base, data = files
    path = tmp_path / name
    path.write_text(HF_TASK.format(base=str(base), data=str(data), lora=lora))
    return train.load_task(path, tmp_path / "cache")


def _mlp_task(tmp_path: Path, lora: str) -> train.LoadedTask:
    path = tmp_path / "mlp.py"
    path.write_text(MLP_TASK.format(lora=lora))
    return train.load_task(path, tmp_path / "cache")


def _trained(task: train.LoadedTask, steps: int = 10) -> tuple[train.InnerTrainer, train.OuterState, train.OuterState]:
    """A trainer after ``steps`` steps from the task's initial state, that state, and the trained one."""
    start = train.init_state(task, 0)
    trainer = train.InnerTrainer(task, lr=1e-2, seed=0)
    trainer.start(start)
    trainer.train_shard(train.shard_indices(task.n_train, 0, 0, 0, 1, steps, task.batch_size))
    delta = trainer.delta(start)
    trained = train.OuterState({k: start.params[k] - delta[k] for k in start.params}, start.momentum)
    return trainer, start, trained


# -- the settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("lora, expect", [
    ("LoRA(r=0)", "LoRA r must be an int from 1 to 4096, got 0"),
    ("LoRA(r=5000)", "LoRA r must be an int from 1 to 4096, got 5000"),
    ("LoRA(r=4.0)", "LoRA r must be an int from 1 to 4096, got 4.0"),
    ("LoRA(r=True)", "LoRA r must be an int from 1 to 4096, got True"),
    ("LoRA(alpha=0)", "LoRA alpha must be a positive number, got 0"),
    ("LoRA(alpha='8')", "LoRA alpha must be a positive number, got '8'"),
    ("LoRA(alpha=float('nan'))", "LoRA alpha must be a positive number, got nan"),
    ("LoRA(dropout=1.0)", "LoRA dropout must be in [0, 1), got 1.0"),
    ("LoRA(dropout=-0.1)", "LoRA dropout must be in [0, 1), got -0.1"),
    ("LoRA(target_modules=[])", "LoRA target_modules must be 'all-linear' or a list of module names, got []"),
    ("LoRA(target_modules=['fc1', ''])", "LoRA target_modules must be 'all-linear' or a list of module names"),
    ("LoRA(target_modules=[1])", "LoRA target_modules must be 'all-linear' or a list of module names, got [1]"),
    ("LoRA(base_bits=8)", "LoRA base_bits must be 16 (the folder's dtype) or 4 (QLoRA), got 8"),
    ("'yes'", "lora must be a ttpeer.train.LoRA, got str"),
])
def test_a_lora_setting_out_of_range_is_a_task_error_naming_the_task(tmp_path, lora, expect):
    with pytest.raises(TaskError) as caught:
        _mlp_task(tmp_path, lora)
    message = str(caught.value)
    assert message.startswith(f"task file {tmp_path / 'mlp.py'}: ") and expect in message, message
    assert "\n" not in message


def test_an_infinite_alpha_is_refused_like_any_other_setting_out_of_range(tmp_path):
    with pytest.raises(TaskError, match="LoRA alpha must be"):
        _mlp_task(tmp_path, "LoRA(alpha=float('inf'), target_modules=['fc1'])")


@pytest.mark.parametrize("lora", [
    LoRA(),
    LoRA(r=8, alpha=16, dropout=0.0, target_modules=["v_proj", "q_proj"], base_bits=4),
    LoRA(r=1, alpha=0.5, dropout=0.1, target_modules=("fc1",)),
])
def test_the_settings_key_reads_back_as_the_same_settings(lora):
    key = lora.key()
    again = LoRA.from_key(key)
    assert again.key() == key
    assert (again.r, again.alpha, again.dropout, again.base_bits) == (lora.r, lora.alpha, lora.dropout,
                                                                     lora.base_bits)
    targets = lora.targets()
    assert again.targets() == (targets if isinstance(targets, str) else sorted(targets))


def test_the_settings_key_is_canonical_and_from_key_refuses_anything_else():
    # The order of target names, or an int alpha, is not a different task.
    assert LoRA(alpha=8, target_modules=["q_proj", "v_proj"]).key() == \
        LoRA(alpha=8.0, target_modules=("v_proj", "q_proj")).key()
    assert LoRA(r=4).key() != LoRA(r=8).key()
    for text in ("", "[]", "null", json.dumps({"r": 4}), "not json"):
        with pytest.raises(ValueError, match="not LoRA settings"):
            LoRA.from_key(text)


def test_qlora_on_a_peer_without_cuda_says_the_default_base_bits_trains_here():
    problem = train.qlora_problem("cpu")
    assert problem is not None and "needs a CUDA GPU" in problem and "base_bits=16" in problem
    assert "trains on cpu" in problem


# -- the adapters are the state --------------------------------------------------------------------


def test_a_lora_hf_task_state_is_its_fp32_adapters_alone_and_loads_back_strictly(tmp_path, files):
    task = _hf_task(tmp_path, files)
    model = task.spec.model()
    state = model.state_dict()
    assert state and all(".lora_A." in n or ".lora_B." in n for n in state), sorted(state)[:4]
    assert {t.dtype for t in state.values()} == {torch.float32}
    # 2 layers x 7 linear layers (all-linear leaves the head out) x (A and B).
    assert len(state) == 2 * 7 * 2 and not any("lm_head" in n for n in state)
    trainable, total = train.parameter_counts(model)
    assert trainable == sum(t.numel() for t in state.values()) < total
    result = model.load_state_dict({k: torch.ones_like(v) for k, v in state.items()}, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert all(torch.equal(t, torch.ones_like(t)) for t in model.state_dict().values())
    # The job's initial state has the same names and shapes, B zero: training starts from the base.
    init = train.init_state(task, 0).params
    assert {k: v.shape for k, v in init.items()} == {k: v.shape for k, v in state.items()}
    assert all(not v.any() for k, v in init.items() if ".lora_B." in k)
    assert task.spec.info["lora"] == LoRA(r=4, alpha=8, dropout=0.0).key()


def test_the_lora_settings_and_the_base_weights_are_part_of_the_task_hash(tmp_path, files):
    _, data = files
    base, tok = tmp_path / "base", tmp_path / "tok"
    shutil.copytree(files[0], base)
    # The tokenizer from a folder of its own: the base's hash alone covers its weights.
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(files[0] / name, tok / name)
    settings = tmp_path / "lora.json"
    path = tmp_path / "t.py"
    path.write_text(SETTINGS_TASK.format(settings=str(settings), base=str(base), tok=str(tok), data=str(data)))

    def loaded(lora: dict | None) -> train.LoadedTask:
        settings.write_text(json.dumps(lora))
        return train.load_task(path, tmp_path / "cache")

    adapters = loaded({"r": 4, "alpha": 8})
    full, other_r = loaded(None), loaded({"r": 8, "alpha": 8})
    assert full.own_hash == adapters.own_hash == other_r.own_hash  # one file: only the settings differ
    assert len({adapters.source_hash, full.source_hash, other_r.source_hash}) == 3
    assert loaded({"r": 4, "alpha": 8.0}).source_hash == adapters.source_hash
    # A peer whose base folder holds other weights (same names, same sizes) declines: another task.
    other = llama_folder(tmp_path / "other", seed=6)
    weights = base / "model.safetensors"
    assert weights.stat().st_size == (other / "model.safetensors").stat().st_size
    shutil.copyfile(other / "model.safetensors", weights)
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # past the hash cache's stamp
    assert loaded({"r": 4, "alpha": 8}).source_hash != adapters.source_hash


def test_target_modules_that_match_nothing_is_one_line_naming_the_targets(tmp_path, files):
    with pytest.raises(TaskError) as caught:
        _hf_task(tmp_path, files, "LoRA(target_modules=['nope_proj'])")
    message = str(caught.value)
    assert message.startswith(f"task file {tmp_path / 't.py'}: LoRA target_modules ['nope_proj']: ")
    assert "nope_proj" in message.split(": ", 2)[2] and "\n" not in message


def test_target_modules_naming_a_layer_peft_cannot_adapt_is_one_line(tmp_path, files):
    with pytest.raises(TaskError) as caught:
        _hf_task(tmp_path, files, "LoRA(target_modules=['mlp'])")
    assert "target_modules ['mlp']" in str(caught.value) and "\n" not in str(caught.value)


def test_a_single_module_name_given_as_a_string_is_refused_or_means_that_name(tmp_path, files):
    try:
        task = _hf_task(tmp_path, files, "LoRA(r=4, alpha=8, target_modules='q_proj')")
    except TaskError as exc:
        assert "a list of module names" in str(exc) and "not found" not in str(exc), str(exc)
    else:
        state = task.spec.model().state_dict()
        assert state and all(".q_proj.lora_" in n for n in state)


def test_lora_over_a_config_is_refused_for_it_has_no_weights_to_keep(tmp_path, files):
    path = tmp_path / "t.py"
    path.write_text(HF_TASK.format(base=TINY_GPT2, data=str(files[1]), lora="LoRA()"))
    with pytest.raises(TaskError, match="a config has no weights to keep: give the model's folder"):
        train.load_task(path, tmp_path / "cache")
    # Without lora the same config trains from scratch.
    train.load_task(task_file(tmp_path / "plain.py", TINY_GPT2, files[1], block_size=32, tokenizer=files[0]),
                    tmp_path / "cache")


@pytest.mark.slow
def test_a_generic_task_with_named_targets_trains_its_adapters_alone(tmp_path):
    task = _mlp_task(tmp_path, "LoRA(r=4, alpha=8, dropout=0.0, target_modules=['fc1', 'fc2'])")
    trainer, start, trained = _trained(task, steps=40)
    assert sorted(start.params) == sorted(f"base_model.model.{layer}.lora_{ab}.default.weight"
                                          for layer in ("fc1", "fc2") for ab in "AB")
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    assert base and all("base_layer" in n for n in base)
    trainer.train_shard(train.shard_indices(task.n_train, 0, 1, 0, 1, 5, task.batch_size))
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if n in base)
    assert all(trained.params[k].abs().max() > 0 for k in trained.params if ".lora_B." in k)
    before, _ = trainer.evaluate(dict(start.params))
    after, _ = trainer.evaluate(dict(trained.params))
    assert after < before, (before, after)


def test_all_linear_on_a_model_that_is_not_hugging_face_says_to_name_the_layers(tmp_path):
    with pytest.raises(TaskError) as caught:
        _mlp_task(tmp_path, "LoRA()")
    message = str(caught.value)
    assert "target_modules='all-linear' is for Hugging Face models; name the layers to adapt" in message
    assert message.startswith(f"task file {tmp_path / 'mlp.py'}: ") and "\n" not in message


# -- training and evaluating --------------------------------------------------------------------------


@pytest.mark.slow
def test_the_evaluation_model_shares_the_frozen_base_and_sees_the_trained_adapters(tmp_path, files):
    task = _hf_task(tmp_path, files)
    trainer, start, trained = _trained(task)
    frozen = {n: p for n, p in trainer.model.named_parameters() if not p.requires_grad}
    mine = dict(trainer.model.named_parameters())
    evaluation = trainer._eval_model()
    theirs = dict(evaluation.named_parameters())
    assert theirs.keys() == mine.keys() and frozen
    assert all(theirs[n].data_ptr() == p.data_ptr() for n, p in frozen.items())  # the base itself, no copy
    adapters = [n for n, p in mine.items() if p.requires_grad]
    assert adapters and all(theirs[n].data_ptr() != mine[n].data_ptr() for n in adapters)
    before, ppl_before = trainer.evaluate(dict(start.params))
    after, ppl_after = trainer.evaluate(dict(trained.params))
    assert after != before and ppl_after != ppl_before
    assert after < before, (before, after)  # chat answers that repeat the question reversed: learnt fast


# -- will it fit ---------------------------------------------------------------------------------------


def test_the_fit_check_counts_the_frozen_base_but_gradients_and_adamw_of_the_adapters_only(tmp_path, files):
    task = _hf_task(tmp_path, files)
    model = task.spec.model()
    adapters, total = train.parameter_counts(model)
    need = train.memory_need(task, batch_size=8, shards=2)
    assert (need.params, need.total_params) == (adapters, total)
    assert total * 4 <= need.model <= total * 4 + 4096  # every parameter at fp32 (the CPU's base dtype), buffers
    assert need.grads == adapters * 4 and need.optimizer == 2 * need.grads
    assert need.host == 3 * adapters * 4  # the outer copies hold the adapters alone
    misfit = train.fit_problem(need, device="cpu", device_free=need.total // 2, host_free=need.total // 2)
    assert misfit is not None
    assert f"training adapters of {adapters / 1000:.1f}K parameters over this frozen {total / 1000:.1f}K-parameter " \
        "model needs about" in misfit.message, misfit.message
    assert train.fit_problem(need, device="cpu", device_free=need.total, host_free=need.total) is None


def test_a_4bit_base_counts_its_linear_weights_at_nf4_size_and_its_head_at_its_dtype(tmp_path, files):
    from ttpeer.train._fit import NF4_BYTES

    full = train.memory_need(_hf_task(tmp_path, files), batch_size=8, shards=2)
    four = train.memory_need(_hf_task(tmp_path, files, "LoRA(r=4, alpha=8, dropout=0.0, base_bits=4)", "q.py"),
                             batch_size=8, shards=2)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(files[0])
    head = hf.get_output_embeddings()
    linear = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    assert four.params == full.params and four.total_params == full.total_params
    assert four.model == pytest.approx(full.model - linear * (4 - NF4_BYTES), abs=1)


def test_a_full_fine_tune_that_does_not_fit_is_told_to_train_lora_adapters_instead(tmp_path, files):
    base, data = files
    full = train.load_task(task_file(tmp_path / "full.py", base, data, block_size=32), tmp_path / "cache")
    fit = train.fit_batch(full, batch_size=8, shards=2, device="cpu", device_free=1 << 16, host_free=1 << 16)
    assert fit.misfit is not None and fit.misfit.message.endswith(
        "to fine-tune it on this peer, train adapters over the frozen model: hf_causal_lm(..., lora=LoRA()) "
        "needs a fraction of this")
    adapters = _hf_task(tmp_path, files)
    fit = train.fit_batch(adapters, batch_size=8, shards=2, device="cpu", device_free=1 << 16, host_free=1 << 16)
    assert fit.misfit is not None and "lora=LoRA()" not in fit.misfit.message  # already adapters


def test_a_lora_task_is_refused_for_an_ensemble_job(tmp_path, files):
    task = _hf_task(tmp_path, files)
    with pytest.raises(TaskError, match="trains LoRA adapters over a frozen base: that is a fused job"):
        train.check_job(task, {"rounds": 5, "batches": 8, "mode": "ensemble"})
    train.check_job(task, {"rounds": 5, "batches": 8, "mode": "fused"})


# -- export ----------------------------------------------------------------------------------------------


def _export(folder: Path, task: train.LoadedTask, state: train.OuterState) -> tuple[Path, dict]:
    """The fused export of ``state`` in ``folder``, and its sidecar."""
    folder.mkdir(exist_ok=True)
    out = folder / "final.safetensors"
    train.export_model(state, task, out, {"rounds": 1})
    return out, json.loads(out.with_suffix(".json").read_text())


def test_export_refuses_adapters_of_a_full_fine_tune_and_a_plain_hf_folder_of_adapters(tmp_path, files):
    base, data = files
    full = train.load_task(task_file(tmp_path / "full.py", base, data, block_size=32), tmp_path / "cache")
    out, sidecar = _export(tmp_path / "full", full, train.init_state(full, 0))
    with pytest.raises(train.CheckpointError, match="--format peft is for a job that trained LoRA adapters; this "
                       "one trained every parameter: --format hf writes it"):
        export_hf(out, sidecar, tmp_path / "a", fmt="peft")
    with pytest.raises(train.CheckpointError, match="--merge is for a job that trained LoRA adapters"):
        export_hf(out, sidecar, tmp_path / "b", fmt="hf", merge=True)
    lora = _hf_task(tmp_path, files)
    out, sidecar = _export(tmp_path / "lora", lora, train.init_state(lora, 0))
    with pytest.raises(train.CheckpointError, match="this job trained LoRA adapters over a frozen base: --format "
                       "peft writes the adapters"):
        export_hf(out, sidecar, tmp_path / "c", fmt="hf")
    assert not any((tmp_path / name).exists() for name in "abc")


@pytest.mark.slow
def test_a_peft_export_gives_the_logits_of_the_trained_job_and_a_merged_one_nearly(tmp_path, files):
    import peft
    from transformers import AutoModelForCausalLM

    task = _hf_task(tmp_path, files)
    _trainer, _start, trained = _trained(task)
    out, sidecar = _export(tmp_path, task, trained)
    adapters = export_hf(out, sidecar, tmp_path / "peft", fmt="peft")
    assert adapters.name == "adapter_model.safetensors"
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8, str(files[0].resolve()))
    ids = torch.tensor([[3, 9, 14, 7, 1, 4, 11, 5, 1]])
    with torch.no_grad():
        want = train.load_model(out, task)(ids)
        base = AutoModelForCausalLM.from_pretrained(files[0], local_files_only=True, dtype=torch.float32)
        got = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()(input_ids=ids).logits
    assert torch.equal(got, want)
    export_hf(out, sidecar, tmp_path / "merged", fmt="hf", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-5)
    assert not any(".lora_" in n for n in merged.state_dict())


@pytest.mark.slow
def test_a_peft_folder_warm_starts_the_same_adapters_and_a_folder_without_them_is_told_at_submit(tmp_path, files):
    from ttpeer._submit_cmd import recipe_fields
    from ttpeer.cli import build_parser
    from ttpeer.errors import UsageError

    task = _hf_task(tmp_path, files)
    _trainer, _start, trained = _trained(task)
    out, sidecar = _export(tmp_path, task, trained)
    export_hf(out, sidecar, tmp_path / "peft", fmt="peft")
    # peft names the tensors ...lora_A.weight; the live model, ...lora_A.default.weight
    warm = train.warm_state(task, tmp_path / "peft" / "adapter_model.safetensors")
    assert warm.params.keys() == trained.params.keys()
    assert all(torch.equal(warm.params[n], trained.params[n]) for n in trained.params)
    assert all(not m.any() for m in warm.momentum.values())

    def init(path: Path) -> dict:
        args = build_parser().parse_args(["submit", "--task", "t.py", "--init", str(path)])
        return recipe_fields(args, None)

    assert init(tmp_path / "peft")["init"] == str((tmp_path / "peft" / "adapter_model.safetensors").absolute())
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="is a folder without adapter_model.safetensors: give a peft adapter folder"):
        init(tmp_path / "empty")


def test_a_big_model_is_probed_on_two_samples_and_any_other_on_its_batch(tmp_path, files, monkeypatch):
    from ttpeer.train import _probe

    seen: list[int] = []
    real = _probe.fetch_batch
    def counted(data, indices):
        seen.append(len(indices))
        return real(data, indices)

    monkeypatch.setattr(_probe, "fetch_batch", counted)
    train.probe(_hf_task(tmp_path, files), batch_size=8)
    assert seen == [2, 2]  # a 7B base's probe at the job's batch would need its activations whole
    seen.clear()
    train.probe(_mlp_task(tmp_path, "None"), batch_size=8)
    assert seen == [8, 8]  # a task file's own model: the job's batch, as it will train


@pytest.mark.slow
def test_a_base_folder_that_changed_since_training_is_refused_for_a_merge_and_a_load(tmp_path, files):
    from ttpeer._export import load_folder

    task = _hf_task(tmp_path, files)
    _trainer, _start, trained = _trained(task, steps=2)
    out, sidecar = _export(tmp_path, task, trained)
    export_hf(out, sidecar, tmp_path / "peft", fmt="peft")
    assert load_folder(tmp_path / "peft") is not None  # the base as trained: loads
    changed = {**sidecar, "task_info": {**sidecar["task_info"], "hf_model_sha256": "0" * 64}}
    with pytest.raises(train.CheckpointError, match="is gone or changed; put it back at that path to merge"):
        export_hf(out, changed, tmp_path / "merged", fmt="hf", merge=True)
    assert not (tmp_path / "merged").exists()
    (tmp_path / "peft" / "ttpeer.json").write_text(json.dumps(changed))
    with pytest.raises(train.CheckpointError, match="is gone or changed; put it back at that path to load these"):
        load_folder(tmp_path / "peft")
