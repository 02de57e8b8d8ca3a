"""The demo's printed report, from outcomes made here: it fits 80 columns, names its paced
steps, says what the runs show whichever way they went, and ends with the next commands.
(tests/integration/test_demo.py runs the demo itself.)"""

from __future__ import annotations

import io
import time

from rich.console import Console

from ttpeer import demo
from ttpeer.demo import Outcome


def _outcomes(fused_curve, ensemble_acc=0.485, fused_hashes=("b" * 64,) * 3):
    solo = Outcome("one peer alone", 0.457, 14.2, 0, None, ["a" * 64], None,
                   [(0.44 * (i + 1), 0.2 + 0.008 * i) for i in range(31)] + [(14.0, 0.457)])
    fused = Outcome("fused pool, 3 peers", 0.544, 15.6, 2**20, 3.9, list(fused_hashes), None, fused_curve)
    ensemble = Outcome("ensemble, 3 members", ensemble_acc, 22.4, 0, None, ["c" * 64] * 3, 0.469,
                       [(5.0 + 2 * i, 0.26 + 0.03 * i) for i in range(8)])
    return solo, fused, ensemble


def _render(outcomes) -> str:
    console = Console(width=demo.WIDTH, file=io.StringIO(), highlight=False)
    with demo.progress_bar(console) as progress:
        for o, unit in zip(outcomes, ("rounds", "rounds", "units"), strict=True):
            task = progress.add_task(o.label, total=32, t0=time.monotonic(), wall=None, unit=unit, metric="")
            progress.update(task, completed=32, wall=o.wall_s, metric=f"acc {o.accuracy:.3f}")
    demo.print_report(console, *outcomes, steps=640)
    return console.file.getvalue()


def test_the_report_fits_80_columns_and_ends_with_the_next_commands():
    out = _render(_outcomes([(0.5 + 0.44 * i, 0.2 + 0.011 * i) for i in range(32)]))
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80, out
    assert "each paced to 20 ms" in out and "stands for a GPU's" in out
    assert "4 peers share" in out and "no network between them" in out
    assert lines[-len(demo.NEXT_STEPS):] == [line.rstrip() for line in demo.NEXT_STEPS]
    assert all(len(line) <= 80 for line in demo.NEXT_STEPS)
    # each progress line's seconds are the table's wall time for that run
    for label, wall in (("one peer alone", "14.2 s"), ("fused pool, 3 peers", "15.6 s"),
                        ("ensemble, 3 members", "22.4 s")):
        bar = next(line for line in lines if line.startswith(label))
        row = next(line for line in lines if line.startswith(f"│ {label}"))
        assert bar.endswith(wall) and row.rstrip(" │").endswith(wall), (bar, row)
    # the fused pool first reached 0.457 at 0.5 + 0.44 * 24 s (0.2 + 0.011 * 24 >= 0.457)
    assert "time to 0.457" in out and "11.1 s" in out
    assert "reached one peer's final accuracy in 11.1 s, 0.79x one peer's 14.0 s" in " ".join(lines)
    assert "beat its best member alone, 0.469" in " ".join(lines)
    assert "Bit-identical on the 3 peers" in out


def test_the_findings_say_so_when_the_pool_falls_short():
    solo, fused, ensemble = _outcomes([(1.0, 0.3), (2.0, 0.4)], ensemble_acc=0.45,
                                      fused_hashes=("b" * 64, "b" * 64, "d" * 64))
    said = " ".join(demo.findings(solo, fused, ensemble))
    assert "did not reach one peer's final accuracy in 15.6 s" in said
    assert "did not beat its best member alone" in said
    assert "DIFFERENT on the 3 peers: the fused model" in said
    assert "not reached" in _render((solo, fused, ensemble))


def test_every_run_trains_the_same_steps_a_peer():
    rounds = 3
    for shards in (1, 3):
        fused = demo.paced_spec(rounds, shards)
        assert fused["shards"] == shards and fused["batch_size"] == demo.BATCH
        assert fused["rounds"] * fused["batches"] == rounds * demo.SPAN
    ensemble = demo.paced_ensemble_spec(rounds)
    assert ensemble["mode"] == "ensemble" and ensemble["members"] == 3 and ensemble["batch_size"] == demo.BATCH
    assert ensemble["rounds"] * ensemble["batches"] == rounds * demo.SPAN
