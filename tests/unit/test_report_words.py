"""``ttpeer report`` says what the job was: an ensemble in its own words (members,
units, each member's lr; no outer optimizer, no quantized deltas), and the figures
of a running job as "so far", not "final". ``status --watch`` too: units and members,
no compression for whole checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from ttpeer._report import render_html
from ttpeer._watch import render
from ttpeer.proto import RecordSet, sign

from .proto_helpers import Pool, job_body, key

MEMBERS = [{"seed": 11, "lr": 0.0005, "weight_decay": 0.01}, {"seed": 12, "lr": 0.002, "weight_decay": 0.0},
           {"seed": 13, "lr": 0.001, "weight_decay": 0.01}]


def _page(**job: object) -> str:
    pool = Pool("report")
    node = key("r0")
    rs = RecordSet(pool.id)
    for rec in pool.admit([node]):
        rs.add(rec)
    record = sign("job", pool.id, job_body(**job), node)
    rs.add(record)
    pytest.importorskip("matplotlib")
    return render_html(record, rs, peer_name="n0", note=None)[0]


def test_an_ensemble_report_speaks_of_members_and_their_learning_rates():
    page = _page(mode="ensemble", shards=3, members=MEMBERS, batches=60)
    assert "3 members x 60 AdamW steps" in page and "lr 0.0005-0.002" in page
    assert "member checkpoints" in page
    for fused_word in ("Nesterov", "int8", "shards x", "compressed deltas"):
        assert fused_word not in page


def test_a_fused_report_keeps_its_outer_optimizer():
    page = _page()
    assert "outer Nesterov lr 0.7 momentum 0.9; deltas int8" in page and "4 shards x 2 inner steps" in page


def test_a_running_job_reports_its_figures_so_far():
    page = _page()
    assert "so far (0 rounds closed)" in page and "final" not in page.lower().replace("finally", "")


def test_status_watch_says_when_this_peer_is_behind_the_pool():
    st = json.loads((Path(__file__).parent / "fixtures" / "status.json").read_text())
    st["jobs"][0].update(mode="fused", state="running", declined=None, round=5, training_shard=None,
                         held_round=2, rounds_trained=0, rounds_looked_at=3)
    console = Console(width=200, record=True)
    console.print(render(st))
    text = console.export_text()
    assert "catching up: this peer holds round 2's model, the pool is at round 6" in text
    assert "trained none of the last 3 rounds" in text


def test_status_watch_speaks_of_members_for_an_ensemble():
    st = json.loads((Path(__file__).parent / "fixtures" / "status.json").read_text())
    st["jobs"][0].update(mode="ensemble", compression_ratio=1.1)
    console = Console(width=160, record=True)
    console.print(render(st))
    text = console.export_text()
    assert "units" in text and "members" in text and "compression" not in text
    st["jobs"][0].update(mode="fused", compression_ratio=4.2)
    console = Console(width=160, record=True)
    console.print(render(st))
    assert "compression 4.2x" in console.export_text()
