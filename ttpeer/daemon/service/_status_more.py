"""Fields the running service adds to the status snapshot (``_status``), within
schema version 1: fields are only ever added.

    "metrics_url": "http://127.0.0.1:9464/metrics" | null
    "startup_repairs": ["what the start-up check found and repaired", ...]
    jobs[i]["history"]:     [{"round", "eval_loss", "eval_metric", "metric_name",
                              "contributions", "peers", "state", "train_loss"}]  (closed rounds)
    jobs[i]["advice"]:      what to change when the rounds show overfitting, or null (_views)
    jobs[i]["peers"]:       [{"id", "name", "contributions", "used", "shards", "samples",
                              "samples_per_s", "train_s", "compute_s", "comm_s", "idle_s",
                              "wall_s", "claims", "shards_done", "started"}]   (see _views)
    jobs[i]["utilization"]: this peer's time in inner steps / wall since the job began here
    jobs[i]["seconds"]:     this peer's {"train", "compute", "comm", "wall"} on the job
"""

from __future__ import annotations

from typing import Any

from ..node._status import NodeView
from ._usage import Usage
from ._views import advice, history, peer_rows


def extend(status: dict[str, Any], node: NodeView, usage: Usage | None, *, metrics_url: str | None,
           repairs: list[str]) -> dict[str, Any]:
    m = node.machine
    status["metrics_url"] = metrics_url
    status["startup_repairs"] = list(repairs)
    jobs = {job.id: job for job in m.records.jobs()}
    now = usage.clock() if usage else 0.0
    for entry in status.get("jobs", []):
        job = jobs.get(entry["id"])
        if job is None:
            continue
        chain = m.chain(job)
        entry["history"] = history(m.records, chain)
        entry["advice"] = advice(entry["history"])
        entry["peers"] = peer_rows(m.records, job, chain)
        ju = usage.jobs.get(job.id) if usage else None
        entry["utilization"] = ju.utilization(now) if ju else None
        entry["seconds"] = ({"train": round(ju.train_s, 3), "compute": round(ju.compute_s, 3),
                             "comm": round(ju.comm_s, 3), "wall": round(ju.wall(now), 3)} if ju else None)
    return status
