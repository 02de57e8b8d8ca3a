"""``ttpeer status --watch``: the status snapshot drawn with rich, per peer and per round.

``render(status)`` is a pure function from the status JSON (schema: docs/guide/7-watching.md) to a
rich renderable, so what the watch view shows is what ``--json`` says.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ttpeer._behind import behind_lines, round_now
from ttpeer._figures import size as _size

HISTORY_ROWS = 8


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _bar(done: int, total: int, width: int = 24) -> ProgressBar:
    return ProgressBar(total=max(total, 1), completed=min(done, total), width=width)


def _header(st: dict[str, Any]) -> Text:
    node, relay = st["node"], st["relay"]
    text = Text()
    text.append("ttpeer ", style="bold")
    text.append(f"{node['name']} ({node['id'][:12]}) pool {node['pool'][:12]}  ")
    if relay["connected"]:
        text.append("relay connected", style="green")
    else:
        text.append(f"relay NOT connected ({relay['last_error']})", style="red")
    text.append(f"  sent {_size(st['bytes_sent'])}  received {_size(st['bytes_received'])}")
    if st.get("metrics_url"):
        text.append(f"  metrics {st['metrics_url']}", style="dim")
    return text


def _peers(st: dict[str, Any]) -> Table:
    table = Table(title="peers", title_justify="left", expand=False)
    for col in ("name", "id", "role", "heard", "state"):
        table.add_column(col)
    for p in st["peers"]:
        seen = p["last_seen_s"]
        heard = "this machine" if p["self"] else ("never" if seen is None else f"{seen:.0f}s ago")
        live = p.get("liveness", "")
        style = {"alive": "green", "suspect": "yellow", "dead": "red"}.get(live, "")
        table.add_row(p["name"], p["id"][:12], p["role"], heard, Text(live, style=style))
    return table


def _job(job: dict[str, Any]) -> RenderableType:
    ensemble = job["mode"] == "ensemble"  # units of members, whole checkpoints: no rounds of compressed shards
    head = Table.grid(padding=(0, 2))
    head.add_row(
        Text(f"{job['id'][:12]} {job['task']} {job['mode']}", style="bold"),
        Text(job["state"], style="green" if job["state"] in ("running", "done")
             else "red" if job["state"] in ("failed", "cancelled") else "yellow"),
        Text("units" if ensemble else "rounds"), _bar(job["round"], job["rounds"]),
        Text(f"{round_now(job)}/{job['rounds']}"),
        Text("members" if ensemble else "shards"), _bar(job["shards_done"], job["shards_total"], 12),
        Text(f"{job['shards_done']}/{job['shards_total']}"),
    )
    facts = [f"eval loss {_num(job['eval_loss'], '.4f')}", f"{job['metric_name']} {_num(job['eval_metric'], '.4f')}"]
    if job.get("compression_ratio") and not ensemble:
        facts.append(f"compression {job['compression_ratio']:.1f}x")
    if job.get("utilization") is not None:
        facts.append(f"utilization here {100 * job['utilization']:.0f}%")
    if job.get("declined"):
        facts.append(f"{'failed' if job['state'] == 'failed' else 'declined'} here: {job['declined']}")
    end = job.get("ended")
    if end and end["by"]:
        facts.append(f"cancelled by {end['by']['name']}")
    elif end:
        facts.append("failed on every peer: " + "; ".join(f"{r['name']}: {r['reason']}" for r in end["reasons"]))
    if job.get("phase"):
        facts.append(f"preparing here: {job['phase']}")
    parts: list[RenderableType] = [head, Text("  ".join(facts))]
    if job.get("advice"):
        parts.append(Text(job["advice"], style="yellow"))
    parts += [Text(line, style="yellow") for line in behind_lines(job)]
    peers = job.get("peers") or []
    if peers:
        t = Table(title=f"per peer (round {round_now(job)} now)", title_justify="left")
        for col in ("peer", "claims now", "shards this round", "contributions", "samples/s", "precision",
                    "compute", "comm", "idle"):
            t.add_column(col, justify="left" if col in ("peer", "claims now") else "right")
        for p in peers:
            wall = p["wall_s"] or (p["train_s"] + p["compute_s"] + p["comm_s"] + p["idle_s"])
            claims = ", ".join(map(str, p["claims"])) or ("-" if p.get("started", True) else "preparing")
            t.add_row(p["name"], claims, str(p["shards_done"]),
                      f"{p['contributions']} ({p['used']} used)", _num(p["samples_per_s"], ".0f"),
                      _how(p), _pct(p["train_s"] + p["compute_s"], wall), _pct(p["comm_s"], wall),
                      _pct(p["idle_s"], wall))
        parts.append(t)
    history = job.get("history") or []
    if history:
        t = Table(title="per round", title_justify="left")
        for col in ("round", "eval loss", job["metric_name"], "contributions", "peers"):
            t.add_column(col, justify="right")
        for h in history[-HISTORY_ROWS:]:
            t.add_row(str(h["round"]), _num(h["eval_loss"], ".4f"), _num(h["eval_metric"], ".4f"),
                      str(h["contributions"]), str(len(h["peers"])))
        parts.append(t)
    return Panel(Group(*parts), title=f"job {job['id'][:12]}", title_align="left")


def _how(peer: dict[str, Any]) -> str:
    """Precision and micro-batch, e.g. "bf16 x16"; "-" before its first contribution."""
    if not peer.get("precision"):
        return "-"
    return f"{peer['precision']} x{peer['micro_batch']}" if peer.get("micro_batch") else peer["precision"]


def render(st: dict[str, Any] | Exception) -> RenderableType:
    if isinstance(st, Exception):
        return Text(f"ttpeer: {st}", style="red")
    parts: list[RenderableType] = [_header(st), _peers(st)]
    repairs = st.get("startup_repairs") or []
    if repairs:
        parts.append(Text(f"repaired at start-up: {len(repairs)} damaged file(s); see 'ttpeer status --json'",
                          style="yellow"))
    jobs = st["jobs"]
    parts += [_job(j) for j in jobs] if jobs else [Text("no jobs yet: 'ttpeer submit ...'")]
    return Group(*parts)
