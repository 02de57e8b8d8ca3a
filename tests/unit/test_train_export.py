"""Model export: deterministic bytes and hash, a sidecar, and loading back."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ttpeer.train import CheckpointError, export_model, init_state, load_model, load_task, state_hash

torch.set_num_threads(1)

FIXTURE = Path(__file__).parent / "fixtures" / "task_linear.py"


@pytest.fixture(scope="module")
def linear():
    return load_task(str(FIXTURE), Path("/nonexistent"))


def test_same_state_same_bytes_and_sha256(linear, tmp_path):
    state = init_state(linear, 1)
    first = export_model(state, linear, tmp_path / "a" / "model.safetensors", {"accuracy": 0.5})
    second = export_model(init_state(linear, 1), linear, tmp_path / "b.safetensors",
                          {"accuracy": 0.5})
    data = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert first == second == hashlib.sha256(data).hexdigest()
    assert data == (tmp_path / "b.safetensors").read_bytes()
    assert export_model(init_state(linear, 2), linear, tmp_path / "c.safetensors", {}) != first
    assert not list(tmp_path.glob("**/*.tmp"))


def test_sidecar_and_safetensors_metadata(linear, tmp_path):
    state = init_state(linear, 1)
    out = tmp_path / "model.safetensors"
    digest = export_model(state, linear, out, {"accuracy": 0.75, "round": 12})
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["metrics"] == {"accuracy": 0.75, "round": 12}
    assert sidecar["task"] == "task_linear" and sidecar["source_hash"] == linear.source_hash
    assert sidecar["param_count"] == 8 * 2 + 2
    assert sidecar["state_hash"] == state_hash(state) and sidecar["model_sha256"] == digest
    with safe_open(str(out), framework="pt") as handle:
        assert handle.metadata() == {"ttpeer": "1", "task": "task_linear"}
        assert torch.equal(handle.get_tensor("weight"), state.params["weight"])


def test_load_model_reproduces_outputs(linear, tmp_path):
    state = init_state(linear, 3)
    out = tmp_path / "model.safetensors"
    export_model(state, linear, out, {})
    model = load_model(out, linear)
    x = linear.test.tensors[0][:10]
    expected = torch.func.functional_call(linear.spec.model(), state.params, (x,))
    assert torch.equal(model(x), expected)
    assert not model.training


def test_load_model_refuses_foreign_files(linear, tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(CheckpointError, match="not a safetensors"):
        load_model(garbage, linear)
    state = init_state(linear, 0)
    state.params["extra"] = torch.zeros(1)
    state.momentum["extra"] = torch.zeros(1)
    other = tmp_path / "other.safetensors"
    export_model(state, linear, other, {})
    with pytest.raises(CheckpointError, match="unexpected"):
        load_model(other, linear)
