"""A Hugging Face model through the real thing: a relay and two `ttpeer` daemons (processes
on loopback) train a tiny GPT-2 built from a config on text files made here, end on the
same model, `ttpeer export --format hf` writes a folder transformers loads with the same
weights, and each daemon wrote the rounds as TensorBoard events while they closed."""

from __future__ import annotations

import pytest
import torch

from ttpeer_harness import Cluster, make_pool, ttpeer, wait_for

from ..unit.hf_helpers import TINY_GPT2, task_file, text_files
from ._helpers import job_finished, job_of
from .test_board import RECORD_TAGS, scalars

pytestmark = pytest.mark.slow
pytest.importorskip("transformers", reason="the Hugging Face extra: pip install 'ttpeer[hf]'")

ROUNDS = 2
# Besides the metric: what only the daemon has, the time split of its contributions and its own counters.
LIVE_TAGS = {"eval/perplexity", "pool/samples_per_s", "pool/utilization", "peer/bytes_sent", "peer/bytes_received",
             "peer/utilization"}


def test_a_hf_model_trains_on_two_daemons_exports_to_hf_and_logs_tensorboard(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    task = task_file(tmp_path / "tiny_gpt2.py", TINY_GPT2, text_files(tmp_path / "data"), block_size=32)
    cluster = Cluster(tmp_path)
    try:
        url, fp = cluster.start_relay()
        homes = make_pool(cluster, url, fp, ["alice", "bob"])

        def submit(rounds: int) -> str:
            job = ttpeer("submit", "--task", str(task), "--rounds", str(rounds), "--shards", "4", "--inner-steps",
                         "4", "--batch-size", "8", "--inner-lr", "3e-3", "--home", str(homes[0]))[-1]
            wait_for(lambda: job_finished(homes, job), 120, "both peers to finish the job", poll=0.25)
            return job

        # A first job loads transformers and the data on both daemons; without it the submitter,
        # which loaded them to submit, trains every shard while the other is still importing.
        submit(1)
        job = submit(ROUNDS)
        # Who trained which shard is timing (a fresh machine compiles transformers on first
        # import, seconds in which the submitter may train every shard); either way every
        # round closed on both peers, the member recomputing each close to the same state.
        history = job_of(homes[0], job)["history"]
        assert len(history) == ROUNDS and all(row["peers"] for row in history)
        # Written as the closes arrive, not only at the end: every round is there while the daemons run.
        boards = [h / "tensorboard" / job for h in homes]
        # (a board's folder appears with its first event: until then there is nothing to read)
        wait_for(lambda: all(b.is_dir() and len(scalars(b).get("eval/loss", [])) == ROUNDS for b in boards), 30,
                 "the last round's events")
        hashes = [ttpeer("export", job, str(h / "model.safetensors"), "--home", str(h))[-1] for h in homes]
        assert len(set(hashes)) == 1
        out = tmp_path / "exported"
        lines = ttpeer("export", job, str(out), "--format", "hf", "--home", str(homes[0]))
    finally:
        cluster.close()
    assert "config.json" in lines[0] and "model.safetensors" in lines[0]
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    ours = load_file(homes[0] / "model.safetensors")
    state = loaded.state_dict()
    assert ours and all(torch.equal(state[name], tensor) for name, tensor in ours.items())

    got = [scalars(b) for b in boards]
    for tags in got:
        assert set(tags) == RECORD_TAGS | LIVE_TAGS, sorted(tags)
        assert all([step for step, _ in points] == list(range(1, ROUNDS + 1)) for points in tags.values())
        assert all(v > 0 for _, v in tags["pool/samples_per_s"] + tags["peer/bytes_sent"])
    shared = RECORD_TAGS | {"eval/perplexity", "pool/samples_per_s", "pool/utilization"}  # from signed records
    assert {t: p for t, p in got[0].items() if t in shared} == {t: p for t, p in got[1].items() if t in shared}
