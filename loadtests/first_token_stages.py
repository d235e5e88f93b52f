"""Where the first token waits, by stage, on the edge's direct token path: each measured
request of a load-generator run joined, by its own x-request-id, with the edge Envoy's
access-log line, and the stages between the client's send and its first message read.

Per request, all on this machine's wall clock (one clock: the client's time.time_ns(),
Envoy's START_TIME and the worker's Token.emitted_unix_nanos):

    to_edge       client sent → Envoy's arrival (start_unix_us)
    prepare       arrival → prepared: Envoy's waits on the gateway's answers to the request's
                  headers and body (the external processor's logging info: prepare_headers_us
                  + prepare_body_us), the gRPC hop to the gateway included
    to_worker     prepared → sent to the worker: upstream_sent_us less the preparation (the
                  other filters, routing, a stream on a connection)
    worker_first  sent → the worker built its first message (emitted_unix_nanos): with the
                  stream relay (the default) the relay opening the worker's stream, then the
                  worker's receive and checks, vLLM's queue, prefill and first step, output
                  processing. Split in two by the worker's own RPC log line of the request
                  (its request_id and start_unix_us, when the handler began):
      to_handler     sent → the worker's handler began (the hop, gRPC taking the call in)
      handler_first  → the first message built (the worker's intake, vLLM, its output)
    to_envoy      → its first byte at the edge's router (first_byte_us; the worker sends its
                  headers with its first message; with the relay, through it)
    to_caller     → Envoy's first byte to the caller (first_sent_us)
    to_client     → the client read the first message
    ttft          the client's TTFT: the sum of the above, per request

The per-request joins are exact where a histogram is not; beside them, three services'
histograms read around each run (quantiles estimated within their buckets, which is all a
histogram allows; they count the warm-up's requests too): the gateway's own preparation
(tokenmesh_gateway_direct_prepare_seconds, headers in → prepared answer, without the hop), the
worker's TTFT (tokenmesh_ttft_seconds, its handler's start → first message sent) and vLLM's
(vllm:time_to_first_token_seconds: the engine's arrival → first token), the last also for
vLLM's own server.
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tokenmesh.common.tokens import WORKER_GENERATE

# (key, the markdown table's heading) in the order a first token passes them.
STAGES = (
    ("to_edge", "client → edge"),
    ("prepare", "arrival → prepared"),
    ("to_worker", "prepared → sent to worker"),
    ("worker_first", "sent → worker's first message"),
    ("to_envoy", "→ first byte at Envoy"),
    ("to_caller", "→ first byte to caller"),
    ("to_client", "→ client reads it"),
    ("ttft", "client TTFT"),
)
# The parts of "prepare" and of "worker_first" also summed up (in the JSON report; the
# worker's parts only where its log line was found).
PARTS = ("prepare_headers", "prepare_body", "to_handler", "handler_first")
VLLM_TTFT = "vllm:time_to_first_token_seconds"
# What each histogram is called in the report: (service, metric).
HISTOGRAMS = {
    "gateway_prepare": ("gateway", "tokenmesh_gateway_direct_prepare_seconds"),
    "worker_ttft": ("worker", "tokenmesh_ttft_seconds"),
    "engine_ttft": ("worker", VLLM_TTFT),
}
# Envoy writes its access log every second or so; a run's last lines come that much later.
LOG_WAIT_SECONDS = 15.0
EDGE = "edge"


@dataclass(frozen=True)
class EdgeTimes:
    """One stream's line in the edge's access log: its start (µs since the epoch) and the
    waits after it, µs (the processor's: None without the external processor)."""

    start_us: int
    prepare_headers_us: int | None
    prepare_body_us: int | None
    upstream_sent_us: int
    first_byte_us: int
    first_sent_us: int

    @property
    def prepare_us(self) -> int:
        """The edge's waits on the gateway: its answers to the headers and to the body."""
        return (self.prepare_headers_us or 0) + (self.prepare_body_us or 0)


def number(value: Any) -> int | None:
    """An access-log field as an integer; None for Envoy's "-" or an absent value."""
    if value is None or value == "-" or value == "":
        return None
    return int(value)


def edge_times(lines: Iterable[bytes | str], ids: set[str] | None = None) -> dict[str, EdgeTimes]:
    """The edge's lines (JSON, listener "edge") of streams that reached a worker, by request
    id (only `ids`' when given). Envoy's own log lines and other listeners' are skipped."""
    found: dict[str, EdgeTimes] = {}
    for line in lines:
        text = line.decode() if isinstance(line, bytes) else line
        if not text.startswith("{"):
            continue
        row = json.loads(text)
        request_id = row.get("request_id")
        if row.get("listener") != EDGE or not request_id or (ids and request_id not in ids):
            continue
        times = [
            number(row.get(key))
            for key in ("start_unix_us", "upstream_sent_us", "first_byte_us", "first_sent_us")
        ]
        start, sent, first_byte, first_sent = times
        if start is None or sent is None or first_byte is None or first_sent is None:
            continue  # no answer from upstream: no first token to place
        headers, body = (number(row.get(key)) for key in ("prepare_headers_us", "prepare_body_us"))
        found[request_id] = EdgeTimes(start, headers, body, sent, first_byte, first_sent)
    return found


def handler_starts(lines: Iterable[bytes | str], ids: set[str]) -> dict[str, int]:
    """When the worker's handler began each of these requests (µs since the epoch), by request
    id, from the worker's JSON log (its RPC log lines of Generate, common/interceptors.py)."""
    found: dict[str, int] = {}
    for line in lines:
        text = line.decode() if isinstance(line, bytes) else line
        if not text.startswith("{") or WORKER_GENERATE not in text:
            continue
        row = json.loads(text)
        request_id, start = row.get("request_id"), row.get("start_unix_us")
        if row.get("method") == WORKER_GENERATE and request_id in ids and start:
            found[request_id] = int(start)
    return found


def stages(
    sent_ns: int, first_ns: int, emitted_ns: int, edge: EdgeTimes, handler_us: int | None = None
) -> dict[str, float]:
    """One request's stages, ms: the client's send and first-message times and the worker's
    first message's emitted time (wall clock, ns) placed around the edge's line; with the
    worker's handler start (µs), worker_first's two parts too."""
    start = edge.start_us * 1000
    upstream_sent = start + edge.upstream_sent_us * 1000
    prepared = start + edge.prepare_us * 1000
    first_byte = start + edge.first_byte_us * 1000
    first_sent = start + edge.first_sent_us * 1000
    ns = {
        "to_edge": start - sent_ns,
        "prepare": prepared - start,
        "to_worker": upstream_sent - prepared,
        "worker_first": emitted_ns - upstream_sent,
        "to_envoy": first_byte - emitted_ns,
        "to_caller": first_sent - first_byte,
        "to_client": first_ns - first_sent,
        "ttft": first_ns - sent_ns,
        # The preparation's two round trips to the gateway (not stages of their own: they
        # make up "prepare").
        "prepare_headers": (edge.prepare_headers_us or 0) * 1000,
        "prepare_body": (edge.prepare_body_us or 0) * 1000,
    }
    if handler_us is not None:
        ns["to_handler"] = handler_us * 1000 - upstream_sent
        ns["handler_first"] = emitted_ns - handler_us * 1000
    return {key: round(value / 1e6, 3) for key, value in ns.items()}


def joined(
    firsts: Iterable[Iterable[Any]],
    lines: Mapping[str, EdgeTimes],
    handlers: Mapping[str, int] | None = None,
) -> list[dict[str, float]]:
    """Each measured request's stages (RunConfig.request_ids' rows: request id, sent ns,
    first message ns, emitted ns) whose edge line was found; requests without one (or without
    the worker's emitted time) are left out. handlers: the worker's handler starts (µs) by
    request id."""
    rows = []
    for request_id, sent_ns, first_ns, emitted_ns in firsts:
        edge = lines.get(request_id)
        if edge is not None and emitted_ns:
            handler = (handlers or {}).get(request_id)
            rows.append(stages(sent_ns, first_ns, emitted_ns, edge, handler))
    return rows


def percentile(ordered: list[float], q: float) -> float:
    """The nearest-rank percentile (q in 0..1) of sorted values."""
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def summary(rows: list[dict[str, float]], requests: int) -> dict[str, Any]:
    """p50 and p99 of every stage over the joined requests, and how many joined."""
    figures: dict[str, Any] = {"requests": requests, "joined": len(rows)}
    for key in [key for key, _ in STAGES] + list(PARTS):
        values = sorted(row[key] for row in rows if key in row)
        if values:
            figures[key] = {
                "p50_ms": round(percentile(values, 0.5), 2),
                "p99_ms": round(percentile(values, 0.99), 2),
            }
    return figures


class LogTail:
    """A log file's lines written after it was opened."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def lines(self) -> list[bytes]:
        with self.path.open("rb") as log:
            log.seek(self.offset)
            return log.read().splitlines()


class EdgeLog(LogTail):
    """The edge Envoy's access log (its stdout, the mesh's log_dir/envoy.log)."""

    def times(self, ids: set[str], within: float = LOG_WAIT_SECONDS) -> dict[str, EdgeTimes]:
        """The lines of `ids`, waiting up to `within` seconds for Envoy to write them all."""
        deadline = time.monotonic() + within
        while True:
            found = edge_times(self.lines(), ids)
            if len(found) >= len(ids) or time.monotonic() > deadline:
                return found
            time.sleep(0.5)


def buckets(metrics_port: int, metrics: Iterable[str]) -> dict[str, dict[float, float]]:
    """Each of these histograms' cumulative bucket counts (upper bound → count), summed over
    their label sets, from a service's /metrics."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return parse_buckets(reply.read().decode(), metrics)


def parse_buckets(text: str, metrics: Iterable[str]) -> dict[str, dict[float, float]]:
    wanted = {f"{metric}_bucket": metric for metric in metrics}
    found: dict[str, dict[float, float]] = {metric: {} for metric in wanted.values()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            metric = wanted.get(sample.name)
            if metric is not None:
                bound = float(sample.labels["le"])
                found[metric][bound] = found[metric].get(bound, 0.0) + float(sample.value)
    return found


def difference(after: dict[float, float], before: dict[float, float]) -> dict[float, float]:
    return {bound: count - before.get(bound, 0.0) for bound, count in after.items()}


def bucket_quantile(counts: Mapping[float, float], q: float) -> float | None:
    """The q-quantile (0..1) of a histogram's cumulative bucket counts, ms: interpolated
    within its bucket, as Prometheus' histogram_quantile does (the highest finite bound when
    it falls in the +Inf bucket); None when the histogram is empty."""
    bounds = sorted(counts)
    total = counts[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        if counts[bound] >= rank:
            if math.isinf(bound):
                return round(lower * 1000, 2)
            share = (rank - below) / (counts[bound] - below) if counts[bound] > below else 1.0
            return round((lower + (bound - lower) * share) * 1000, 2)
        lower, below = bound, counts[bound]
    return round(lower * 1000, 2)


def histogram_summary(counts: Mapping[str, Mapping[float, float]]) -> dict[str, Any]:
    """p50 and p99 (ms) of each histogram's counts over a run, and its count."""
    return {
        name: {
            "p50_ms": bucket_quantile(buckets_, 0.5),
            "p99_ms": bucket_quantile(buckets_, 0.99),
            "count": int(max(buckets_.values(), default=0)),
        }
        for name, buckets_ in counts.items()
    }


def cell(figures: Mapping[str, Any] | None) -> str:
    if not figures or figures.get("p50_ms") is None:
        return ""
    return f"{figures['p50_ms']} / {figures['p99_ms']}"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The stages of each row that has them (and the histograms' figures), p50 / p99 ms."""
    keys = [key for key, _ in STAGES]
    split = keys.index("worker_first") + 1
    keys[split:split] = ["to_handler", "handler_first"]
    titles = dict(STAGES) | {
        "to_handler": "of it: sent → worker's handler",
        "handler_first": "of it: handler → first message",
    }
    headings = [titles[key] for key in keys] + [
        "gateway's preparation (histogram)",
        "worker TTFT (histogram)",
        "vLLM TTFT (histogram)",
    ]
    lines = [
        "| path | streams | joined | " + " | ".join(headings) + " |",
        "|---|---|---|" + "---|" * len(headings),
    ]
    for row in rows:
        found = row.get("first_token_stages") or {}
        histograms = found.get("histograms", {})
        if not found.get("joined") and not any(cell(h) for h in histograms.values()):
            continue
        cells = [cell(found.get(key)) for key in keys]
        # Without joined lines (vLLM's server), the client's TTFT of the run.
        cells[-1] = cells[-1] or cell(row.get("ttft_ms"))
        cells += [cell(histograms.get(name)) for name in HISTOGRAMS]
        joined_ = f"{found.get('joined', 0)} of {found.get('requests', 0)}"
        lines.append(
            f"| {row['path']} | {row['streams']} | {joined_} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"
