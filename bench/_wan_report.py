"""The WAN bench's rows and what it prints of them: the table, the targets, the plot
(``bench/wan.py`` runs the rows; ``bench/speedup.py`` prints its own with ``plot``)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BATCH = 64
PEERS = 2


@dataclass
class Row:
    name: str
    curve: list[tuple[float, int, float]] = field(default_factory=list)  # (t, samples, loss)
    sent: list[int] = field(default_factory=list)  # bytes per peer
    samples: int = 0
    wall: float = 0.0
    utilization: float | None = None
    note: str = ""
    reference: bool = False  # only its loss against samples counts, not its time or bytes
    rounds: list[int] = field(default_factory=list)  # ttpeer: inner steps per shard of each round
    step_s: float | None = None  # seconds a step took (a peer's mean), where known

    def time_to(self, target: float) -> float | None:
        return next((t for t, _, loss in self.curve if loss <= target), None)

    def samples_to(self, target: float) -> int | None:
        return next((n for _, n, loss in self.curve if loss <= target), None)

    def loss_at(self, samples: int) -> float | None:
        """The eval loss after ``samples``, linear between the evaluations around it."""
        for (_, s0, l0), (_, s1, l1) in zip(self.curve, self.curve[1:], strict=False):
            if s0 <= samples <= s1:
                return l0 if s1 == s0 else l0 + (l1 - l0) * (samples - s0) / (s1 - s0)
        return self.curve[-1][2] if self.curve and self.curve[-1][1] == samples else None


def table(rows: list[Row], target: float) -> tuple[str, int]:
    ran = [r for r in rows if r.curve]
    ours = next((r for r in ran if r.name.startswith("ttpeer")), None)
    equal = ours.samples if ours else min(r.samples for r in ran)
    lines = [f"| system | time to eval loss {target:g} | vs ttpeer | bytes sent / peer | bytes / sample | "
             f"utilization | samples | eval loss at {equal} samples | final eval loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    ref = ours.time_to(target) if ours else None
    for r in rows:
        if not r.curve:
            lines.append(f"| {r.name} | {r.note} | | | | | | | |")
            continue
        t = r.time_to(target)
        vs = f"{t / ref:.2f}x" if t is not None and ref else "n/a"
        if r.reference:
            lines.append(f"| {r.name} | - | - | - | - | - | {r.samples} | "
                         f"{_fmt(r.loss_at(equal))} | {r.curve[-1][2]:.4f} |")
            continue
        if t is None:
            last = r.curve[-1]
            t_txt = f"not reached in {r.wall:.0f} s (at {last[2]:.3f})"
            vs = f"> {r.wall / ref:.1f}x" if ref else "n/a"
        else:
            t_txt = f"{t:.1f} s"
        sent = sum(r.sent) / len(r.sent) if r.sent else 0
        per_sample = sum(r.sent) / r.samples if r.samples else math.nan
        util = f"{r.utilization:.1%}" if r.utilization is not None else "n/a"
        lines.append(f"| {r.name} | {t_txt} | {vs} | {sent / 1e6:.2f} MB | {per_sample:,.1f} | {util} | "
                     f"{r.samples} | {_fmt(r.loss_at(equal))} | {r.curve[-1][2]:.4f} |")
    for r in ran:
        if r.name.startswith("ttpeer"):
            lines += ["", f"Targets, {r.name}:", "", _targets(rows, target, equal, r)]
    return "\n".join(lines), equal


def _fmt(loss: float | None) -> str:
    return f"{loss:.4f}" if loss is not None else "n/a"


def _targets(rows: list[Row], target: float, equal: int, ours: Row) -> str:
    """The issue's targets for the ttpeer row ``ours``, each as measured in this run."""
    def find(prefix: str) -> Row | None:
        return next((r for r in rows if r.name.startswith(prefix) and r.curve), None)

    single, ddp, ft = find("one peer"), find("gloo"), find("torchft")
    same_math = find("DDP, same math") or ddp
    if ours is None:
        return ""
    t = ours.time_to(target)
    out = ["| target | measured | met |", "|---|---|---|"]

    def ratio(name: str, a: float | None, b: float | None, goal: str, ok: Callable[[float], bool],
              bound: str = "") -> None:
        if a is None or b is None or not b:
            out.append(f"| {name} ({goal}) | n/a{bound} | no |")
        else:
            out.append(f"| {name} ({goal}) | {a / b:.2f}{bound} | {'yes' if ok(a / b) else 'no'} |")

    if single:
        ratio("ttpeer time to target / one peer's", t, single.time_to(target), "<= 0.6, limit 0.5", lambda x: x <= 0.6)
    if ddp:
        d = ddp.time_to(target)
        ratio("DDP time to target / ttpeer's", d if d is not None else ddp.wall, t, ">= 20", lambda x: x >= 20,
              "" if d is not None else " (DDP never reached it: a lower bound)")
        ratio("DDP bytes per sample / ttpeer's", sum(ddp.sent) / ddp.samples, sum(ours.sent) / ours.samples,
              ">= 1000", lambda x: x >= 1000)
    if same_math:
        a, b = ours.loss_at(equal), same_math.loss_at(equal)
        ratio(f"ttpeer eval loss / DDP's at {equal} samples", a, b, "<= 1.02", lambda x: x <= 1.02)
    if ft:
        ratio("ttpeer time to target / torchft DiLoCo's", t, ft.time_to(target), "<= 1", lambda x: x <= 1)
    if single and same_math:  # not a target: the ceiling the first one runs into
        a, b = single.samples_to(target), same_math.samples_to(target)
        out.append("| (not a target) one peer's steps to target / DDP's: what perfect 2-peer data parallelism "
                   f"buys on this task | {a / BATCH / (b / BATCH / PEERS):.2f} | |" if a and b else
                   "| (not a target) one peer's steps to target / DDP's | n/a | |")
    util = ours.utilization
    out.append(f"| ttpeer utilization (>= 97%) | {util:.1%} | {'yes' if util >= 0.97 else 'no'} |"
               if util is not None else "| ttpeer utilization (>= 97%) | n/a | no |")
    return "\n".join(out)


def plot(rows: list[Row], target: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=80)
    for r in rows:
        if r.curve and not r.reference:  # a loopback reference's clock is not comparable
            ax.plot([max(t, 0.1) for t, _, _ in r.curve], [loss for _, _, loss in r.curve], label=r.name,
                    marker="." if len(r.curve) < 40 else None)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_xscale("log")
    ax.set_xlabel("wall time, s (log)")
    ax.set_ylabel("eval loss")
    ax.set_title(textwrap.fill(title, 110), fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
