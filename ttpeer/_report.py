"""``ttpeer report JOB OUT.html``: one self-contained page about a job.

It reads this peer's record log (read-only; no daemon needed, and a running one is
not disturbed), so any peer can report on any job: every peer holds every record.
The page has no external resource: three PNG plots (matplotlib, Agg) embedded as
``data:`` URIs, and tables.

- loss per round: the closer's eval loss after each closed round (and the task
  metric on a second axis), from the close records of the canonical chain;
- per-peer throughput: samples per second in inner steps, from each
  contribution's ``samples_per_s``;
- each peer's time split into compute (inner steps and other torch work),
  communication (blob transfers) and idle, summed over its contributions
  (``_usage`` explains how a peer measures them). These are self-reported by each
  peer; a contribution from a peer that does not report them counts as unknown.

Raises ``JobError`` for an unknown or ambiguous job, ``HomeError`` for a home
that is not enrolled.
"""

from __future__ import annotations

import base64
import html
import importlib.util
import io
import time
from pathlib import Path
from typing import Any

from ttpeer.daemon import Home
from ttpeer.daemon.service._integrity import scan_log
from ttpeer.daemon.service._views import history, peer_rows, throughput
from ttpeer.errors import JobError, UsageError
from ttpeer.proto import Plan, Record, RecordError, RecordSet, canonical_chain, parse

COLORS = {"compute": "#3b7dd8", "comm": "#e8a33d", "idle": "#b9b9b9"}


def load_records(home: Home) -> tuple[RecordSet, str | None]:
    """Every verified record in the home's log, and a note if its tail was unreadable."""
    cfg = home.config()
    try:
        data = home.records_log.read_bytes()
    except FileNotFoundError:
        data = b""
    scan = scan_log(data)
    rs = RecordSet(cfg.pool)
    for raw in scan.frames:
        try:
            rs.add(parse(raw))
        except RecordError:
            continue
    note = None
    if scan.problem is not None:
        note = f"the record log's last {scan.size - scan.good_end} bytes were not readable ({scan.problem})"
    return rs, note


def find_job(rs: RecordSet, prefix: str) -> Record:
    found = [j for j in rs.jobs() if j.id.startswith(prefix.lower())]
    if not found:
        raise JobError(f"no job {prefix!r} in this peer's records (see 'ttpeer status')")
    if len(found) > 1:
        raise UsageError(f"job prefix {prefix!r} is ambiguous; give more characters")
    return found[0]


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _figure(width: float = 7.0, height: float = 3.4) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _rounds_axis(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666666")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_loss(rows: list[dict[str, Any]]) -> str:
    fig = _figure()
    ax = fig.subplots()
    rows = [r for r in rows if r["eval_loss"] is not None]
    if not rows:
        _empty(ax, "no round has closed yet")
    else:
        x = [r["round"] for r in rows]
        ax.plot(x, [r["eval_loss"] for r in rows], marker="o", color="#c0392b", label="eval loss")
        _rounds_axis(ax)
        ax.set_ylabel("eval loss", color="#c0392b")
        ax.grid(alpha=0.3)
        metric = [r["eval_metric"] for r in rows]
        if all(m is not None for m in metric):
            ax2 = ax.twinx()
            ax2.plot(x, metric, marker="s", linestyle="--", color="#2471a3")
            ax2.set_ylabel(rows[0]["metric_name"], color="#2471a3")
        ax.set_title("loss per round (evaluated by the round's closer)")
    return _png(fig)


def plot_throughput(points: dict[str, list[tuple[int, float]]], names: dict[str, str]) -> str:
    fig = _figure()
    ax = fig.subplots()
    if not points:
        _empty(ax, "no contribution reports its throughput")
    else:
        for pid, series in sorted(points.items(), key=lambda kv: names.get(kv[0], kv[0])):
            mean = sum(v for _, v in series) / len(series)
            ax.plot([r for r, _ in series], [v for _, v in series], marker="o",
                    label=f"{names.get(pid, pid[:12])} (mean {mean:,.0f})")
        _rounds_axis(ax)
        ax.set_ylabel("samples / s in inner steps")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        ax.set_title("per-peer throughput")
    return _png(fig)


def plot_time_split(peers: list[dict[str, Any]]) -> str:
    fig = _figure(7.0, 0.9 + 0.55 * max(1, len(peers)))
    ax = fig.subplots()
    rows = [p for p in peers if p["wall_s"] > 0]
    if not rows:
        _empty(ax, "no contribution reports its time split")
    else:
        labels = [p["name"] for p in rows]
        parts = {
            "compute": [p["train_s"] + p["compute_s"] for p in rows],
            "comm": [p["comm_s"] for p in rows],
            "idle": [p["idle_s"] for p in rows],
        }
        left = [0.0] * len(rows)
        for kind, values in parts.items():
            label = {"compute": "compute", "comm": "communication", "idle": "idle"}[kind]
            ax.barh(labels, values, left=left, color=COLORS[kind], label=label)
            for i, v in enumerate(values):
                total = sum(parts[k][i] for k in parts)
                if total and v / total >= 0.08:
                    ax.text(left[i] + v / 2, i, f"{100 * v / total:.0f}%", ha="center", va="center", fontsize=8)
            left = [a + b for a, b in zip(left, values, strict=True)]
        ax.set_xlabel("seconds on the job (summed over the peer's contributions)")
        ax.invert_yaxis()
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.5 / len(rows) - 0.25), ncol=3,
                  frameon=False)
        ax.set_title("each peer's time: compute, communication, idle")
    return _png(fig)


_CSS = """
body{font:15px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:60rem;color:#222;
padding:0 1rem}
h1{font-size:1.5rem;margin-bottom:.2rem}h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5rem 0}td,th{padding:.2rem .7rem;border-bottom:1px solid #eee;
text-align:right}th{background:#f6f6f6}td:first-child,th:first-child{text-align:left}
.facts td{text-align:left}.note{color:#8a5a00}.dim{color:#777;font-size:.9rem}img{max-width:100%}
code{font-size:.9em}
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _fmt(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _table(head: list[str] | None, rows: list[list[Any]], cls: str = "") -> str:
    out = [f"<table class='{cls}'>"]
    if head:
        out.append("<tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>")
    return "\n".join(out) + "</table>"


def render_html(job: Record, rs: RecordSet, *, peer_name: str, note: str | None) -> tuple[str, dict[str, Any]]:
    chain = canonical_chain(rs, job)
    rounds = history(rs, chain)
    peers = peer_rows(rs, job, chain)
    names = {pid: m.name for pid, m in rs.members.items()}
    images = {
        "loss per round": plot_loss(rounds),
        "per-peer throughput": plot_throughput(throughput(rs, job), names),
        "time split per peer": plot_time_split(peers),
    }
    last = rounds[-1] if rounds else None
    metric = last["metric_name"] if last else "metric"
    facts = job_facts(job, chain.round, rs.of_job(job.id, "contrib"), names, list(chain.closes))
    # A running job's last close is where it stands, not where it ends.
    when = "final" if Plan.of(job, chain.closes).finished(chain.round) else f"so far ({chain.round} rounds closed)"
    facts[-1:-1] = [[f"eval loss {when}", _fmt(last["eval_loss"] if last else None)],
                    [f"{metric} {when}", _fmt(last["eval_metric"] if last else None)],
                    ["model state", chain.head]]
    peer_table = _table(
        ["peer", "contributions (used)", "shards", "samples", "samples/s (last)", "compute s", "comm s", "idle s",
         "compute", "comm", "idle"],
        [[p["name"], f"{p['contributions']} ({p['used']})", p["shards"], p["samples"],
          _fmt(p["samples_per_s"], ",.0f"), _fmt(p["train_s"] + p["compute_s"], ".1f"), _fmt(p["comm_s"], ".1f"),
          _fmt(p["idle_s"], ".1f"), *_shares(p)] for p in peers])
    round_table = _table(
        ["round", "eval loss", metric, "contributions", "peers"],
        [[r["round"], _fmt(r["eval_loss"]), _fmt(r["eval_metric"]), r["contributions"],
          ", ".join(names.get(a, a[:12]) for a in r["peers"])] for r in rounds])
    figures = "\n".join(
        f"<h2>{_e(title)}</h2>\n<img alt='{_e(title)}' src='data:image/png;base64,{data}'>"
        for title, data in images.items())
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>ttpeer report: job {_e(job.id[:12])}</title>
<style>{_CSS}</style></head>
<body>
<h1>ttpeer report: job <code>{_e(job.id[:12])}</code></h1>
<p class="dim">From the records held by peer {_e(peer_name)}, {generated}. Times are what each peer
reports in its contributions; compute includes inner steps and other torch work.</p>
{f'<p class="note">Note: {_e(note)}.</p>' if note else ''}
{_table(None, facts, "facts")}
{figures}
<h2>peers</h2>
{peer_table}
<h2>rounds</h2>
{round_table}
</body></html>
"""
    summary = {"rounds": chain.round, "peers": len(peers), "images": len(images),
               "final_eval_loss": last["eval_loss"] if last else None}
    return page, summary


def job_facts(job: Record, closed: int, contribs: list[Record], names: dict[str, str],
              closes: list[Record] | None = None) -> list[list[str]]:
    """What the job was, in its own mode's words: a fused job has rounds of shards, an
    outer optimizer and quantized deltas; an ensemble has members trained by AdamW alone
    (each its own lr), in units, whose contributions are member checkpoints."""
    submitted = (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(job["at"]))
                 + f" by {names.get(job.author, job.author[:12])}")
    sent = sum(c["size"] for c in contribs) / 2**20
    peers = len({c.author for c in contribs})
    head = [["job", job.id], ["task", f"{job['task']} ({job['mode']})"], ["submitted", submitted]]
    if job["mode"] == "ensemble":
        members = job["members"]
        lrs = sorted({m["lr"] for m in members})
        wds = sorted({m["weight_decay"] for m in members})
        return head + [
            ["units closed", f"{closed} of {job['rounds']} (each member trains one unit a round)"],
            ["per unit", f"{len(members)} members x {job['batches']} AdamW steps x batch {job['batch_size']}"],
            ["optimizer", f"AdamW per member, lr {_span(lrs)}, weight decay {_span(wds)}; no averaging "
                          "(the members vote at inference)"],
            ["contributions", f"{len(contribs)} from {peers} peers, {sent:.2f} MiB of member checkpoints"],
            *_vote(job, closes or []),
        ]
    if "h_min" in job.body:  # auto cadence: the pool picked each round's size
        rounds = [["rounds closed", f"{closed}, over a budget of {job['rounds'] * job['batches']} inner steps "
                                    "per shard"],
                  ["per round", f"{job['shards']} shards x {job['h_min']}-{job['h_max']} inner steps (picked each "
                                f"round to hide the sync; {job['batches']} at first) x batch {job['batch_size']}"]]
    else:
        rounds = [["rounds closed", f"{closed} of {job['rounds']}"],
                  ["per round", f"{job['shards']} shards x {job['batches']} inner steps x batch {job['batch_size']}"]]
    outer = (f"outer Nesterov lr {job['outer_lr']}{_sched(job, 'outer_')} momentum {job['outer_momentum']}"
             if not job.body.get("outer_auto") else
             "outer Nesterov picked by each close from its contributions"
             + (" and how far the last ones agreed" if job.body.get("outer_auto") == 2 else "") + _picked(closes or []))
    return head + rounds + [
        ["optimizers", f"inner AdamW lr {job['inner_lr']}{_sched(job, '')}, {outer}; deltas int{job['bits']}"],
        ["contributions", f"{len(contribs)} from {peers} peers, {sent:.2f} MiB of compressed deltas"],
    ]


def _vote(job: Record, closes: list[Record]) -> list[list[str]]:
    """How the last close weighed the members in the vote (a job that held samples out)."""
    weights = closes[-1].body.get("weights") if closes else None
    if not weights:
        return []
    return [["vote", f"members counted {', '.join(map(str, weights))} times, weighed on {job['holdout']} training "
                     "samples no member trained on"]]


def _picked(closes: list[Record]) -> str:
    """`` (lr 0.7, momentum 0.54-0.70)``: the outer steps the closes named."""
    steps = [(c["outer_lr"], c["outer_momentum"]) for c in closes if "outer_lr" in c.body]
    if not steps:
        return ""
    return f" (lr {_span(sorted({lr for lr, _m in steps}))}, momentum {_span(sorted({m for _lr, m in steps}))})"


def _span(values: list[float]) -> str:
    return f"{values[0]:g}" if len(values) == 1 else f"{values[0]:g}-{values[-1]:g}"


def _shares(p: dict[str, Any]) -> list[str]:
    total = p["train_s"] + p["compute_s"] + p["comm_s"] + p["idle_s"]
    if total <= 0:
        return ["-", "-", "-"]
    return [f"{100 * v / total:.0f}%" for v in (p["train_s"] + p["compute_s"], p["comm_s"], p["idle_s"])]


def write_report(home: Home, prefix: str, out: Path) -> str:
    """Write the report for the job ``prefix`` names to ``out``; returns a summary line.
    Raises UsageError, before reading anything, where matplotlib is not installed."""
    from ttpeer.daemon._files import write_atomic

    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("'ttpeer report' draws its charts with matplotlib, which is not installed here: "
                         "pip install 'ttpeer[report]'")

    rs, note = load_records(home)
    job = find_job(rs, prefix)
    page, summary = render_html(job, rs, peer_name=home.config().name, note=note)
    write_atomic(out, page.encode(), 0o644)
    return (f"job {job.id[:12]}, {summary['rounds']} rounds, {summary['peers']} peers, "
            f"{summary['images']} plots, {len(page) / 1024:.0f} KiB")


def _sched(job: Any, prefix: str) -> str:
    """`` (cosine, warm-up 10)`` for a scheduled lr; nothing for a constant one."""
    kind = job.body.get(f"{prefix}lr_schedule", "constant")
    warmup = job.body.get(f"{prefix}warmup", 0)
    if kind == "constant" and not warmup:
        return ""
    unit = "rounds" if prefix else "steps"
    return f" ({kind}" + (f", warm-up {warmup} {unit}" if warmup else "") + ")"
