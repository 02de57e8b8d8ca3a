"""The opt-in Prometheus endpoint: ``GET /metrics`` on a loopback address.

Off unless ``metrics = "127.0.0.1:9464"`` (or ``--metrics``, ``TTPEER_METRICS``);
the configuration refuses any address but loopback, since the endpoint has no
authentication. It is a small HTTP/1.1 server on the daemon's own trio loop: each
scrape builds the metrics from the same status snapshot ``ttpeer status`` shows,
on the trio thread, so numbers never race the node.

Metrics (``job`` label: the first 12 hex digits of the job id):

    ttpeer_up{node,name}                 1
    ttpeer_peers, ttpeer_peers_alive     members; members heard from recently (and this one)
    ttpeer_relay_connected               1 while the relay answers
    ttpeer_bytes_sent_total, ttpeer_bytes_received_total
    ttpeer_job_rounds_closed{job,task}, ttpeer_job_rounds{job,task}
    ttpeer_job_shards_done{job}, ttpeer_job_shards{job}           the current round
    ttpeer_job_shards_trained_total{job}                           by this peer
    ttpeer_job_compression_ratio{job}    fp32 bytes / wire bytes of this peer's deltas
    ttpeer_job_eval_loss{job}, ttpeer_job_eval_metric{job,metric}  from the last close
    ttpeer_job_utilization{job}          time in inner steps / wall, this peer
    ttpeer_job_seconds_total{job,kind}   kind: train, compute, comm
    ttpeer_job_state{job,state}          1 for the job's state
    ttpeer_startup_repairs               damaged files the start-up check repaired
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger("ttpeer.metrics")
MAX_REQUEST = 8192
ALIVE_S = 60.0


def families(status: dict[str, Any], shards_trained: dict[str, int]) -> Iterator[Metric]:
    """Prometheus metric families from an (extended) status snapshot."""
    node = status["node"]
    up = GaugeMetricFamily("ttpeer_up", "The ttpeer daemon is running", labels=["node", "name"])
    up.add_metric([node["id"][:12], node["name"]], 1)
    yield up
    peers = status["peers"]

    def alive(p: dict[str, Any]) -> bool:
        if p.get("self"):
            return True
        if "liveness" in p:
            return p["liveness"] == "alive"
        return p["last_seen_s"] is not None and p["last_seen_s"] <= ALIVE_S

    yield GaugeMetricFamily("ttpeer_peers", "Members of the pool", value=len(peers))
    yield GaugeMetricFamily("ttpeer_peers_alive", "Members heard from recently, this one included",
                            value=sum(1 for p in peers if alive(p)))
    yield GaugeMetricFamily("ttpeer_relay_connected", "1 while the relay answers",
                            value=1 if status["relay"]["connected"] else 0)
    touches = status["relay"].get("touches", {})
    yield CounterMetricFamily("ttpeer_relay_blobs_touched", "Dataset piece blobs whose relay TTL this peer "
                              "restarted (running jobs' pin)", value=touches.get("blobs", 0))
    yield CounterMetricFamily("ttpeer_bytes_sent", "Bytes sent to the relay", value=status["bytes_sent"])
    yield CounterMetricFamily("ttpeer_bytes_received", "Bytes received from the relay",
                              value=status["bytes_received"])
    yield GaugeMetricFamily("ttpeer_startup_repairs", "Damaged files the start-up check repaired",
                            value=len(status.get("startup_repairs", [])))

    g = {name: GaugeMetricFamily(f"ttpeer_job_{name}", text, labels=labels) for name, text, labels in [
        ("rounds_closed", "Rounds closed", ["job", "task"]),
        ("rounds", "Rounds the job has", ["job", "task"]),
        ("shards_done", "Shards covered in the current round", ["job"]),
        ("shards", "Shards per round", ["job"]),
        ("compression_ratio", "fp32 bytes over wire bytes of this peer's deltas", ["job"]),
        ("eval_loss", "Eval loss after the last closed round", ["job"]),
        ("eval_metric", "Task metric after the last closed round", ["job", "metric"]),
        ("utilization", "Time in inner steps over wall time since the job began on this peer", ["job"]),
        ("state", "1 for the job's state", ["job", "state"]),
    ]}
    trained = CounterMetricFamily("ttpeer_job_shards_trained", "Shards trained by this peer", labels=["job"])
    seconds = CounterMetricFamily("ttpeer_job_seconds", "This peer's seconds on the job, by kind",
                                  labels=["job", "kind"])
    for job in status["jobs"]:
        jid = job["id"][:12]
        g["rounds_closed"].add_metric([jid, job["task"]], job["round"])
        g["rounds"].add_metric([jid, job["task"]], job["rounds"])
        g["shards_done"].add_metric([jid], job["shards_done"])
        g["shards"].add_metric([jid], job["shards_total"])
        g["state"].add_metric([jid, job["state"]], 1)
        if job.get("compression_ratio") is not None:
            g["compression_ratio"].add_metric([jid], job["compression_ratio"])
        if job.get("eval_loss") is not None:
            g["eval_loss"].add_metric([jid], job["eval_loss"])
        if job.get("eval_metric") is not None:
            g["eval_metric"].add_metric([jid, job["metric_name"]], job["eval_metric"])
        if job.get("utilization") is not None:
            g["utilization"].add_metric([jid], job["utilization"])
        trained.add_metric([jid], shards_trained.get(job["id"], 0))
        for kind in ("train", "compute", "comm"):
            if job.get("seconds"):
                seconds.add_metric([jid, kind], job["seconds"][kind])
    yield from g.values()
    yield trained
    yield seconds


class _Collector:
    def __init__(self, source: Callable[[], Iterator[Metric]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        return self._source()


def exposition(source: Callable[[], Iterator[Metric]]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(source))  # type: ignore[arg-type]
    return generate_latest(registry)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"


async def serve_metrics(
    render: Callable[[], bytes], listen: str, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``render()`` at ``/metrics`` on ``listen`` (HOST:PORT; port 0 picks one).
    Reports the URL through ``task_status``. Raises ``OSError`` if it cannot bind."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    listeners = await trio.open_tcp_listeners(int(port), host=host)
    bound = listeners[0].socket.getsockname()[1]

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            with trio.move_on_after(5):
                head = b""
                while b"\r\n\r\n" not in head and len(head) < MAX_REQUEST:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        return
                    head += chunk
                parts = head.split(b"\r\n", 1)[0].split()
                path = parts[1].split(b"?")[0] if len(parts) >= 2 else b""
                if parts[:1] == [b"GET"] and path == b"/metrics":
                    try:
                        code, ctype, body = "200 OK", CONTENT_TYPE_LATEST, render()
                    except Exception:  # a bug in a metric must not take the daemon down
                        log.exception("building the metrics failed")
                        code, ctype, body = "500 Internal Server Error", "text/plain", b"error\n"
                else:
                    code, ctype, body = "404 Not Found", "text/plain", b"ttpeer metrics: GET /metrics\n"
                header = (f"HTTP/1.1 {code}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                          "Connection: close\r\n\r\n").encode()
                try:
                    await stream.send_all(header + body)
                except trio.BrokenResourceError:
                    pass

    url = _url(host, bound)
    log.info("Prometheus metrics at %s", url)
    task_status.started(url)
    await trio.serve_listeners(handle, listeners)
