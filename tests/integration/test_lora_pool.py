"""LoRA through the real thing: a relay and three `ttpeer` daemons (processes on loopback)
fine-tune adapters over a tiny Llama-shaped base (random weights saved as a bf16 folder,
with a chat template) on chat JSON lines. The adapters alone are the job's state and end
bit-identical on every peer; `--format peft` writes a folder that `peft` loads in a fresh
process over the base, giving the logits `ttpeer.load` gives (of the export, and of
that folder); `--format hf --merge` writes one that `transformers` loads alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ttpeer_harness import Cluster, make_pool, ttpeer, wait_for

from ..unit.hf_helpers import chat_file, llama_folder
from ._helpers import job_finished, job_of

pytestmark = pytest.mark.slow
pytest.importorskip("peft", reason="the Hugging Face extra: pip install 'ttpeer[hf]'")

ROUNDS = 2
TASK = """from ttpeer.tasks import LoRA, hf_causal_lm


def task():
    return hf_causal_lm({base!r}, data={data!r}, block_size=32, batch_size=8,
                        lora=LoRA(r=4, alpha=8, dropout=0.0))
"""
# In a fresh process: the base from its folder, the adapters through peft alone.
PEFT_LOGITS = """import sys, torch, peft, transformers
torch.set_num_threads(1)  # as below: one thread sums in one order, so the logits can be equal bit for bit
base = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
model = peft.PeftModel.from_pretrained(base, sys.argv[2]).eval()
ids = torch.tensor([[2, 5, 9, 4, 7, 3, 8, 2, 6, 10]])
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[3])
"""


def test_three_daemons_fine_tune_lora_adapters_on_chat_rows_and_export_them_for_peft(tmp_path):
    from ttpeer import load

    base = llama_folder(tmp_path / "base")
    task = tmp_path / "chat_lora.py"
    task.write_text(TASK.format(base=str(base), data=str(chat_file(tmp_path / "chats.jsonl"))))
    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        homes = make_pool(cluster, url, fp, ["alice", "bob", "carol"])
        lines = ttpeer("submit", "--task", str(task), "--rounds", str(ROUNDS), "--shards", "6", "--inner-steps",
                       "4", "--batch-size", "8", "--inner-lr", "1e-2", "--home", str(homes[0]))
        job = lines[-1]
        wait_for(lambda: job_finished(homes, job), 180, "the three peers to finish the job", poll=0.25)
        history = job_of(homes[0], job)["history"]
        shown = ttpeer("status", "--home", str(homes[2]))  # a peer that did not submit
        hashes = [ttpeer("export", job, str(h / "adapters.safetensors"), "--home", str(h))[-1] for h in homes]
        peft_out, merged_out = tmp_path / "peft", tmp_path / "merged"
        peft_lines = ttpeer("export", job, str(peft_out), "--format", "peft", "--home", str(homes[0]))
        ttpeer("export", job, str(merged_out), "--format", "hf", "--merge", "--home", str(homes[1]))
    finally:
        cluster.close()
    # The submitter says how little trains: 2 layers x 7 linear layers x r (in + out).
    assert any(line.startswith("trainable ") and "parameters (" in line for line in lines), lines
    assert any(line.strip().startswith("adapters: trainable ") for line in shown), shown
    assert len(history) == ROUNDS and all(row["peers"] for row in history)
    assert len(set(hashes)) == 1  # the adapters, bit-identical on every peer
    from safetensors.torch import load_file

    exported = load_file(homes[0] / "adapters.safetensors")
    assert exported and all(".lora_A." in n or ".lora_B." in n for n in exported)  # no base tensor in the state
    assert any(t.abs().max() > 0 for n, t in exported.items() if ".lora_B." in n)  # trained: B starts at zero
    assert "adapter_config.json" in peft_lines[0] and "adapter_model.safetensors" in peft_lines[0]
    config = json.loads((peft_out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(base)

    ids = torch.tensor([[2, 5, 9, 4, 7, 3, 8, 2, 6, 10]])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            want, *folders = (load(where, home=homes[0])(ids) for where in
                              (homes[0] / "adapters.safetensors", peft_out, merged_out))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(folders[0], want)  # ttpeer.load of the peft folder: the same model
    assert torch.allclose(folders[1], want, atol=1e-5)  # of the merged one: the same up to the merge's rounding
    subprocess.run([sys.executable, "-c", PEFT_LOGITS, str(base), str(peft_out), str(tmp_path / "peft.pt")],
                   check=True, timeout=120)
    assert torch.equal(torch.load(tmp_path / "peft.pt"), want)
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(merged_out, local_files_only=True).eval()
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-5)
