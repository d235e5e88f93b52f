"""Generate the Grafana dashboards in dashboards/ from the descriptions below, or check them."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "dashboards"
# Every panel and query variable reads from the data source picked in the `datasource` variable.
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's rate window: at least four scrape intervals, so rate() always has samples.
RATE = "$__rate_interval"
# Status codes that mean the service failed (a caller's own mistakes and cancels are not its
# errors): the same set as the TokenmeshHighErrorRatio alert, as the services label them.
SERVER_ERROR_CODES = (
    "UNKNOWN|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED|UNIMPLEMENTED|INTERNAL|UNAVAILABLE|DATA_LOSS"
)
# Health checks are frequent and say nothing about the service's own calls.
NOT_HEALTH = 'grpc_service!="grpc.health.v1.Health"'
# The public API's calls at the gateways, whichever path their tokens took (a path label:
# gateway or direct).
PUBLIC_CALLS = 'service="gateway"'
# Token streams the workers started (gRPC and OpenAI), whichever path brought them.
WORKER_STREAMS = (
    'service="worker",grpc_service="tokenmesh.v1.InferenceService",'
    'grpc_method=~"Generate|GenerateOpenAI"'
)
# The workers' own series (their token streams, by model with a `model` label).
WORKER_SERVICE = 'service="worker"'
# The workers' LoRA adapter series: data only where adapters are served.
ADAPTER_SERIES = "tokenmesh_worker_adapter_"
CIRCUIT_STATES = {0: ("closed", "green"), 1: ("half-open", "orange"), 2: ("open", "red")}


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    # A Grafana unit id: s, reqps, percentunit, short, ...
    unit: str = "short"
    # Step lines for states (the circuit), smooth lines for rates and latencies.
    stepped: bool = False
    value_names: dict[int, tuple[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Variable:
    """A multi-select query variable over one label's values (All = any value)."""

    name: str
    label: str
    metric: str
    label_name: str

    @property
    def query(self) -> str:
        return f"label_values({self.metric}, {self.label_name})"


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    variables: tuple[Variable, ...] = ()


def quantiles(
    metric: str,
    by: str,
    selector: str,
    qs: tuple[float, ...] = (0.5, 0.99),
    legend: str | None = None,
) -> tuple[Query, ...]:
    """p50/p99 (or qs) of a histogram, one line per `by` value (named by legend, a Grafana
    template; the `by` label by default)."""
    name = legend or f"{{{{{by}}}}}"
    return tuple(
        Query(
            f"histogram_quantile({q}, {rate(metric + '_bucket', 'le, ' + by, selector)})",
            f"{name} p{round(q * 100)}",
        )
        for q in qs
    )


def rate(metric: str, by: str, selector: str = "") -> str:
    """Per-second rate of a counter summed by the `by` labels."""
    series = f"{metric}{{{selector}}}" if selector else metric
    return f"sum by ({by}) (rate({series}[{RATE}]))"


def ratio(numerator: str, denominator: str, matching: str = "") -> str:
    """numerator / denominator where the denominator is above 0: an idle window is a gap,
    not NaN or +Inf. `matching` is the vector matching, e.g. `on (replica)`."""
    return f"{numerator}\n/ {matching + ' ' if matching else ''}({denominator} > 0)"


OVERVIEW = Dashboard(
    uid="tokenmesh-overview",
    title="tokenmesh / Overview",
    description="What callers see at the gateways, and the engine's view of the same streams.",
    variables=(Variable("service", "Measured at", "tokenmesh_ttft_seconds_count", "service"),),
    panels=(
        Panel(
            "Requests/s by gRPC code",
            "Public API calls (LLMService) finished per second, by status code and the path "
            "their tokens took (gateway: through a gateway; direct: from a worker through "
            "Envoy).",
            (
                Query(
                    rate("tokenmesh_gateway_calls_total", "grpc_code, path", PUBLIC_CALLS),
                    "{{grpc_code}} ({{path}})",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Server-side error ratio",
            "Share of finished RPCs with a server-side error code, per service (the "
            "TokenmeshHighErrorRatio alert fires over 5 %). Cancels and invalid requests are "
            "the caller's doing and do not count.",
            (
                Query(
                    "(\n"
                    + rate(
                        "grpc_server_handled_total",
                        "service",
                        f'{NOT_HEALTH},grpc_code=~"{SERVER_ERROR_CODES}"',
                    )
                    + "\n  or "
                    + rate("grpc_server_handled_total", "service", NOT_HEALTH)
                    + " * 0\n)\n/ "
                    + rate(
                        "grpc_server_handled_total",
                        "service",
                        NOT_HEALTH,
                    ),
                    "{{service}}",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Time to first token",
            "From a request's arrival to its first token being sent: at the gateways (what "
            "callers see) and at the workers (the engine); the gap is the gateway's overhead "
            "and the rerank step.",
            quantiles("tokenmesh_ttft_seconds", "service", 'service=~"$service"'),
            unit="s",
        ),
        Panel(
            "Inter-token latency",
            "Gap between consecutive tokens sent on one stream.",
            quantiles("tokenmesh_inter_token_latency_seconds", "service", 'service=~"$service"'),
            unit="s",
        ),
        Panel(
            "End-to-end RPC duration",
            "Whole public API calls, by method and path (a Generate lasts until its last token).",
            quantiles(
                "tokenmesh_gateway_call_seconds",
                "grpc_method, path",
                PUBLIC_CALLS,
                legend="{{grpc_method}} ({{path}})",
            ),
            unit="s",
        ),
        Panel(
            "Token stream duration",
            "From a token stream's request arriving to its last token (or its end), at the "
            "gateways and at the workers.",
            quantiles("tokenmesh_request_duration_seconds", "service", 'service=~"$service"'),
            unit="s",
        ),
        Panel(
            "Tokens/s",
            "Tokens sent to callers and prompt tokens read (per service measuring), and tokens "
            "vLLM read and generated.",
            (
                Query(
                    rate("tokenmesh_tokens_generated_total", "service", 'service=~"$service"'),
                    "sent ({{service}})",
                ),
                Query(
                    rate("tokenmesh_prompt_tokens_total", "service", 'service=~"$service"'),
                    "prompt ({{service}})",
                ),
                Query(
                    "sum(rate(vllm:generation_tokens_total[$__rate_interval]))", "generated (vLLM)"
                ),
                Query("sum(rate(vllm:prompt_tokens_total[$__rate_interval]))", "prompt (vLLM)"),
            ),
            unit="short",
        ),
    ),
)

SERVING = Dashboard(
    uid="tokenmesh-serving",
    title="tokenmesh / Serving load",
    description="Each worker's vLLM engine: batch, queue, KV cache, step sizes.",
    variables=(Variable("worker", "Worker", "tokenmesh_worker_running_requests", "replica"),),
    panels=(
        Panel(
            "Running requests",
            "Requests in the engine's running batch (vLLM scheduler), per worker.",
            (Query('tokenmesh_worker_running_requests{replica=~"$worker"}', "{{replica}}"),),
        ),
        Panel(
            "Waiting requests",
            "Requests queued for a place in the batch; a queue that keeps growing fires "
            "TokenmeshEngineQueueGrowing.",
            (Query('tokenmesh_worker_waiting_requests{replica=~"$worker"}', "{{replica}}"),),
        ),
        Panel(
            "KV-cache use",
            "Fraction of the KV cache in use; near 100 % new requests wait or are preempted.",
            (Query('tokenmesh_worker_kv_cache_usage_ratio{replica=~"$worker"}', "{{replica}}"),),
            unit="percentunit",
        ),
        Panel(
            "Batch size (tokens per engine step)",
            "Tokens vLLM processed per engine step (vllm:iteration_tokens_total): how much "
            "continuous batching packs into one forward pass.",
            (
                *quantiles("vllm:iteration_tokens_total", "replica", 'replica=~"$worker"'),
                Query(
                    rate("vllm:iteration_tokens_total_sum", "replica", 'replica=~"$worker"')
                    + "\n/ "
                    + rate("vllm:iteration_tokens_total_count", "replica", 'replica=~"$worker"'),
                    "{{replica}} mean",
                ),
            ),
        ),
        Panel(
            "Prefix-cache hit rate by worker",
            "Share of the prompt tokens each engine looked up in its prefix cache that it found "
            "there (vllm:prefix_cache_hits / vllm:prefix_cache_queries), per worker and over "
            "all of them. Prefix-aware routing sends prompts that start alike to one worker, "
            "which should show here as a higher rate.",
            (
                Query(
                    ratio(
                        rate("vllm:prefix_cache_hits_total", "replica", 'replica=~"$worker"'),
                        rate("vllm:prefix_cache_queries_total", "replica", 'replica=~"$worker"'),
                    ),
                    "{{replica}}",
                ),
                Query(
                    ratio(
                        f"sum(rate(vllm:prefix_cache_hits_total[{RATE}]))",
                        f"sum(rate(vllm:prefix_cache_queries_total[{RATE}]))",
                    ),
                    "all workers",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Stream share by worker",
            "Each worker's share of the token streams the workers started (Generate and "
            "GenerateOpenAI, their own counts): with prefix-aware routing, how far a hot "
            "prefix tilts the balance (bounded by the balance factor).",
            (
                Query(
                    ratio(
                        rate(
                            "grpc_server_started_total",
                            "replica",
                            f'{WORKER_STREAMS},replica=~"$worker"',
                        ),
                        f"sum(rate(grpc_server_started_total{{{WORKER_STREAMS}}}[{RATE}]))",
                        # An empty label list: `group_left (` would start one.
                        "ignoring (replica) group_left ()",
                    ),
                    "{{replica}}",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Endpoint picker: picks/s by choice",
            "Workers the gateways' endpoint picker named (worker_routing picker), by why: "
            "first (the prompt prefix's own worker), spilled (a later one in the prefix's "
            "ranking: those before it were busier than the slack allows), none (no load "
            "figures: Envoy's least request chose). Empty under least_request and prefix.",
            (
                Query(
                    f"sum by (choice) (rate(tokenmesh_gateway_worker_picks_total[{RATE}]))",
                    "{{choice}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Time queued in vLLM",
            "How long requests waited before the engine scheduled them.",
            quantiles("vllm:request_queue_time_seconds", "replica", 'replica=~"$worker"'),
            unit="s",
        ),
        Panel(
            "Preemptions/s",
            "Requests vLLM preempted (evicted from the KV cache, recomputed later).",
            (
                Query(
                    rate("vllm:num_preemptions_total", "replica", 'replica=~"$worker"'),
                    "{{replica}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Aborted engine requests/s",
            "Engine requests aborted because the caller cancelled or its deadline passed.",
            (
                Query(
                    rate(
                        "tokenmesh_worker_aborted_requests_total",
                        "replica, reason",
                        'replica=~"$worker"',
                    ),
                    "{{replica}} {{reason}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Requests by engine feature/s",
            "Requests that use an engine feature beyond plain sampling: structured outputs by "
            "kind, tools by tool_choice, prompt batches, token-id prompts, echo and prompt "
            "logprobs.",
            (
                Query(
                    rate(
                        "tokenmesh_worker_request_features_total",
                        "feature",
                        'replica=~"$worker"',
                    ),
                    "{{feature}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Tokens/s by model",
            "Tokens the workers sent, by the model or LoRA adapter each stream named (its "
            "`model`), whichever path brought it.",
            (
                Query(
                    rate("tokenmesh_tokens_generated_total", "model", WORKER_SERVICE), "{{model}}"
                ),
            ),
        ),
        Panel(
            "Streams/s by model and code",
            "Token streams the workers ended, by model or adapter and gRPC status code: a "
            "model's errors show as codes other than OK.",
            (
                Query(
                    rate(
                        "tokenmesh_request_duration_seconds_count",
                        "model, grpc_code",
                        WORKER_SERVICE,
                    ),
                    "{{model}} {{grpc_code}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "TTFT by model (at the workers)",
            "Time from a worker receiving a stream to sending its first token, by model or "
            "adapter: an adapter's first request on a worker includes loading it.",
            quantiles("tokenmesh_ttft_seconds", "model", WORKER_SERVICE),
            unit="s",
        ),
        Panel(
            "Adapter loads and evictions/s",
            "LoRA adapters loaded into the engines (at start, or for a request naming one its "
            "engine did not hold), and dropped from an engine's cache (max_cpu_loras) to make "
            "room, by adapter. Loads that keep recurring: more adapters asked of a worker than "
            "its engine holds.",
            (
                Query(rate(f"{ADAPTER_SERIES}loads_total", "adapter"), "{{adapter}} loads"),
                Query(rate(f"{ADAPTER_SERIES}evictions_total", "adapter"), "{{adapter}} evictions"),
            ),
            unit="reqps",
        ),
        Panel(
            "Adapter load time",
            "Seconds a LoRA adapter took to load into an engine, by adapter.",
            quantiles(f"{ADAPTER_SERIES}load_seconds", "adapter", ""),
            unit="s",
        ),
        Panel(
            "Stream pacing: hold and loop lag",
            "How long each stream's later tokens gather into one message (0 while the worker's "
            "server loop keeps up), and that loop's lag in taking the engine's outputs "
            "(decision 0039), by worker.",
            (
                Query(
                    'max by (replica) (tokenmesh_worker_stream_hold_seconds{replica=~"$worker"})',
                    "{{replica}} hold",
                ),
                Query(
                    'max by (replica) (tokenmesh_worker_loop_lag_seconds{replica=~"$worker"})',
                    "{{replica}} loop lag",
                ),
            ),
            unit="s",
        ),
    ),
)

# Resumed streams, moved by the gateways (their token path), handed over by the workers, or
# moved by the edge's stream relay (Envoy's stats of its dynamic module: no _total, the gap in
# milliseconds).
RELAY = "envoy_dynamicmodulescustom_tokenmesh_relay"
RESUMPTIONS = f'{{__name__=~"tokenmesh_(gateway|worker)_resumptions_total|{RELAY}_resumptions"}}'
RESUMPTIONS_REFUSED = (
    f'{{__name__=~"tokenmesh_(gateway|worker)_resumptions_refused_total'
    f'|{RELAY}_resumptions_refused"}}'
)
RESUMPTION_GAP = '{__name__=~"tokenmesh_(gateway|worker)_resumption_gap_seconds_bucket"}'
RELAY_GAP_MS = f"{RELAY}_resumption_gap_ms_bucket"
DEGRADATION = Dashboard(
    uid="tokenmesh-degradation",
    title="tokenmesh / Degradation",
    description="The reranker, the gateways' circuit breaker in front of it, degraded answers, "
    "and streams that moved to another worker.",
    variables=(Variable("gateway", "Gateway", "tokenmesh_reranker_circuit_state", "replica"),),
    panels=(
        Panel(
            "Reranker circuit state",
            "Per gateway: closed (reranker used), half-open (probing), open (answers degraded). "
            "Open or half-open for 3 minutes fires TokenmeshRerankerCircuitOpen.",
            (Query('tokenmesh_reranker_circuit_state{replica=~"$gateway"}', "{{replica}}"),),
            stepped=True,
            value_names=CIRCUIT_STATES,
        ),
        Panel(
            "Circuit transitions",
            "Circuit state changes in each interval, by the state entered.",
            (
                Query(
                    "sum by (to) (increase(tokenmesh_reranker_circuit_transitions_total"
                    '{replica=~"$gateway"}[$__rate_interval]))',
                    "to {{to}}",
                ),
            ),
        ),
        Panel(
            "Degraded responses/s",
            "Answers served without a dependency (documents in their given order, flagged "
            "reranker_unavailable), by reason.",
            (
                Query(
                    rate("tokenmesh_degraded_responses_total", "reason", 'replica=~"$gateway"'),
                    "{{reason}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Rerank latency",
            "At the reranker (queue plus model, answered requests) and at the gateways (the "
            "whole context step, including timeouts and the fallback).",
            (
                *quantiles("tokenmesh_rerank_latency_seconds", "service", 'service="reranker"'),
                *quantiles("tokenmesh_gateway_rerank_seconds", "service", 'replica=~"$gateway"'),
            ),
            unit="s",
        ),
        Panel(
            "Rerank batch size",
            "Requests scored together in one model call (micro-batching), and model calls/s.",
            (
                *quantiles("tokenmesh_rerank_batch_size", "service", 'service="reranker"', (0.5,)),
                Query(rate("tokenmesh_rerank_batch_size_count", "service"), "model calls/s"),
            ),
        ),
        Panel(
            "Reranker hosts in Envoy",
            "Healthy reranker hosts and hosts ejected by Envoy's outlier detection.",
            (
                Query('envoy_cluster_membership_healthy{envoy_cluster_name="reranker"}', "healthy"),
                Query(
                    'envoy_cluster_outlier_detection_ejections_active{envoy_cluster_name="reranker"}',
                    "ejected",
                ),
            ),
        ),
        Panel(
            "Streams moved to another worker/s",
            "Streams that continued on another worker from the token where they stopped, by "
            "why (stream_reset, worker_unavailable: moved by a gateway or the edge's stream "
            "relay; engine_dead: handed over by a worker whose engine died), and those that "
            "could not move, by reason. "
            "Moves in 3 of the last six 5-minute windows fire TokenmeshStreamsKeepMoving.",
            (
                Query(rate(RESUMPTIONS, "cause"), "{{cause}}"),
                Query(rate(RESUMPTIONS_REFUSED, "reason"), "not moved: {{reason}}"),
            ),
            unit="reqps",
        ),
        Panel(
            "Gap a moved stream's caller saw",
            "From the last token before the worker went away to the first from the next one "
            "(its prefill of the prompt and the delivered tokens), p50 and p99: the gateways' "
            "and workers' moves, and the edge's stream relay's.",
            tuple(
                Query(
                    f"histogram_quantile({q}, {rate(RESUMPTION_GAP, 'le')})",
                    f"p{round(q * 100)}",
                )
                for q in (0.5, 0.99)
            )
            + tuple(
                Query(
                    f"histogram_quantile({q}, {rate(RELAY_GAP_MS, 'le')}) / 1000",
                    f"edge relay p{round(q * 100)}",
                )
                for q in (0.5, 0.99)
            ),
            unit="s",
        ),
    ),
)

CLUSTER = 'envoy_cluster_name=~"$cluster"'
MESH = Dashboard(
    uid="tokenmesh-mesh",
    title="tokenmesh / Mesh (Envoy)",
    description="Envoy's clusters and endpoints: health, balancing, ejections, overflow; and the "
    "control plane feeding it.",
    variables=(
        Variable("cluster", "Cluster", "envoy_cluster_membership_total", "envoy_cluster_name"),
    ),
    panels=(
        Panel(
            "Healthy hosts",
            "Hosts per cluster passing Envoy's active health checks, of all known; no healthy "
            "worker fires TokenmeshNoHealthyWorkers.",
            (
                Query(
                    f"envoy_cluster_membership_healthy{{{CLUSTER}}}",
                    "{{envoy_cluster_name}} healthy",
                ),
                Query(
                    f"envoy_cluster_membership_total{{{CLUSTER}}}", "{{envoy_cluster_name}} total"
                ),
            ),
        ),
        Panel(
            "Active requests per endpoint",
            "Streams open from Envoy to each upstream host (least-request balancing evens these).",
            (
                Query(
                    f"envoy_cluster_endpoint_rq_active{{{CLUSTER}}}",
                    "{{envoy_cluster_name}} {{envoy_endpoint_address}}",
                ),
            ),
        ),
        Panel(
            "Request share per endpoint",
            "Each host's share of its cluster's requests.",
            (
                Query(
                    rate(
                        "envoy_cluster_endpoint_rq_total",
                        "envoy_cluster_name, envoy_endpoint_address",
                        CLUSTER,
                    )
                    + "\n/ ignoring (envoy_endpoint_address) group_left\n"
                    + rate("envoy_cluster_endpoint_rq_total", "envoy_cluster_name", CLUSTER),
                    "{{envoy_cluster_name}} {{envoy_endpoint_address}}",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Upstream requests/s and retries/s",
            "Requests Envoy sent to each cluster, and the retries among them.",
            (
                Query(
                    rate("envoy_cluster_upstream_rq_total", "envoy_cluster_name", CLUSTER),
                    "{{envoy_cluster_name}}",
                ),
                Query(
                    rate("envoy_cluster_upstream_rq_retry", "envoy_cluster_name", CLUSTER),
                    "{{envoy_cluster_name}} retries",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Health-check failures/s",
            "Failed active gRPC health checks (NOT_SERVING, timeouts, refused connections).",
            (
                Query(
                    rate("envoy_cluster_health_check_failure", "envoy_cluster_name", CLUSTER),
                    "{{envoy_cluster_name}}",
                ),
                Query(
                    rate(
                        "envoy_cluster_health_check_network_failure", "envoy_cluster_name", CLUSTER
                    ),
                    "{{envoy_cluster_name}} network",
                ),
            ),
        ),
        Panel(
            "Outlier ejections",
            "Hosts ejected now by outlier detection, and ejections enforced per second.",
            (
                Query(
                    f"envoy_cluster_outlier_detection_ejections_active{{{CLUSTER}}}",
                    "{{envoy_cluster_name}} ejected",
                ),
                Query(
                    rate(
                        "envoy_cluster_outlier_detection_ejections_enforced_total",
                        "envoy_cluster_name",
                        CLUSTER,
                    ),
                    "{{envoy_cluster_name}} ejections/s",
                ),
            ),
        ),
        Panel(
            "Circuit-breaker overflow/s",
            "Requests Envoy refused because a cluster's circuit-breaker limit was reached "
            "(pending requests, connections, retry budget).",
            (
                Query(
                    rate(
                        "envoy_cluster_upstream_rq_pending_overflow", "envoy_cluster_name", CLUSTER
                    ),
                    "{{envoy_cluster_name}} pending",
                ),
                Query(
                    rate("envoy_cluster_upstream_cx_overflow", "envoy_cluster_name", CLUSTER),
                    "{{envoy_cluster_name}} connections",
                ),
                Query(
                    rate("envoy_cluster_upstream_rq_retry_overflow", "envoy_cluster_name", CLUSTER),
                    "{{envoy_cluster_name}} retries",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Control plane",
            "Endpoints the xDS control plane serves per cluster, and its pushes and NACKs.",
            (
                Query(
                    'tokenmesh_controlplane_endpoints{cluster=~"$cluster"}',
                    "{{cluster}} {{health}}",
                ),
                Query(rate("tokenmesh_xds_pushes_total", "reason"), "pushes/s ({{reason}})"),
                Query("sum(rate(tokenmesh_xds_nacks_total[$__rate_interval]))", "NACKs/s"),
            ),
        ),
    ),
)

GRPC_SELECTOR = 'service=~"$service",grpc_method=~"$method"'
started = f"grpc_server_started_total{{{GRPC_SELECTOR}}}"
handled = f"grpc_server_handled_total{{{GRPC_SELECTOR}}}"
GRPC = Dashboard(
    uid="tokenmesh-grpc",
    title="tokenmesh / gRPC",
    description="Every service's gRPC server: calls, in flight, codes, messages, durations.",
    variables=(
        Variable("service", "Service", "grpc_server_started_total", "service"),
        Variable(
            "method", "Method", 'grpc_server_started_total{service=~"$service"}', "grpc_method"
        ),
    ),
    panels=(
        Panel(
            "Started/s",
            "RPCs started per second, by service and method.",
            (
                Query(
                    rate("grpc_server_started_total", "service, grpc_method", GRPC_SELECTOR),
                    "{{service}} {{grpc_method}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "In flight",
            "RPCs started and not yet finished (started minus handled), by service and method.",
            (
                Query(
                    f"sum by (service, grpc_method) ({started})\n"
                    f"- sum by (service, grpc_method) ({handled})",
                    "{{service}} {{grpc_method}}",
                ),
            ),
        ),
        Panel(
            "Handled/s by code",
            "RPCs finished per second, by service and status code.",
            (
                Query(
                    rate("grpc_server_handled_total", "service, grpc_code", GRPC_SELECTOR),
                    "{{service}} {{grpc_code}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Stream messages/s",
            "Messages sent (responses, e.g. tokens) and received (requests) per second.",
            (
                Query(
                    rate(
                        "grpc_server_stream_msg_sent_total", "service, grpc_method", GRPC_SELECTOR
                    ),
                    "{{service}} {{grpc_method}} sent",
                ),
                Query(
                    rate(
                        "grpc_server_stream_msg_received_total",
                        "service, grpc_method",
                        GRPC_SELECTOR,
                    ),
                    "{{service}} {{grpc_method}} received",
                ),
            ),
        ),
        Panel(
            "Gateway's calls/s by code",
            "The gateways' own calls to the workers and the reranker (through Envoy), finished "
            "per second by service called and status code.",
            (
                Query(
                    rate("grpc_client_handled_total", "grpc_service, grpc_code"),
                    "{{grpc_service}} {{grpc_code}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Gateway's call time p99",
            "The gateways' calls to the workers and the reranker, from start to end as the "
            "gateway sees them (includes Envoy's hop).",
            (
                Query(
                    "histogram_quantile(0.99, sum by (le, grpc_service, grpc_method) "
                    f"(rate(grpc_client_handling_seconds_bucket[{RATE}])))",
                    "{{grpc_service}} {{grpc_method}}",
                ),
            ),
            unit="s",
        ),
        Panel(
            "Handling time p99",
            "From an RPC's start to its end on the server, by service and method.",
            (
                Query(
                    "histogram_quantile(0.99, sum by (le, service, grpc_method) "
                    f"(rate(grpc_server_handling_seconds_bucket{{{GRPC_SELECTOR}}}[{RATE}])))",
                    "{{service}} {{grpc_method}}",
                ),
            ),
            unit="s",
        ),
    ),
)

DASHBOARDS = (OVERVIEW, SERVING, DEGRADATION, MESH, GRPC)


def file_name(dashboard: Dashboard) -> str:
    return dashboard.uid.removeprefix("tokenmesh-") + ".json"


def variable_json(variable: Variable) -> dict[str, Any]:
    return {
        "name": variable.name,
        "label": variable.label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": variable.query,
        "query": {"query": variable.query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        # Refresh the values when the time range changes (replicas come and go).
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "regex": "",
        "sort": 1,
        "hide": 0,
    }


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    custom: dict[str, Any] = {
        "drawStyle": "line",
        "lineInterpolation": "stepAfter" if panel.stepped else "smooth",
        "lineWidth": 1,
        "fillOpacity": 10,
        "showPoints": "never",
        "spanNulls": False,
    }
    defaults: dict[str, Any] = {"unit": panel.unit, "custom": custom, "min": 0}
    if panel.value_names:
        defaults["mappings"] = [
            {
                "type": "value",
                "options": {
                    str(value): {"text": text, "color": color, "index": index}
                    for index, (value, (text, color)) in enumerate(panel.value_names.items())
                },
            }
        ]
        defaults["max"] = max(panel.value_names)
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {
                "refId": chr(ord("A") + index),
                "datasource": DATASOURCE,
                "expr": query.expr,
                "legendFormat": query.legend,
                "range": True,
            }
            for index, query in enumerate(panel.queries)
        ],
    }


def dashboard_json(dashboard: Dashboard) -> dict[str, Any]:
    datasource_variable = {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "options": [],
        "regex": "",
        "refresh": 1,
        "hide": 0,
    }
    return {
        "id": None,
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": ["tokenmesh"],
        "editable": True,
        # Shared crosshair: a spike lines up across panels.
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [datasource_variable, *(variable_json(v) for v in dashboard.variables)]
        },
        # Two panels per row, in the order described.
        "panels": [
            panel_json(panel, index + 1, 12 * (index % 2), 8 * (index // 2))
            for index, panel in enumerate(dashboard.panels)
        ],
    }


def render(dashboard: Dashboard) -> str:
    return json.dumps(dashboard_json(dashboard), indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="fail when dashboards/ differs from the descriptions"
    )
    args = parser.parse_args()
    expected = {file_name(dashboard): render(dashboard) for dashboard in DASHBOARDS}
    if args.check:
        present = {path.name for path in OUT_DIR.glob("*.json")}
        stale = sorted(
            name
            for name in expected.keys() | present
            if name not in present
            or name not in expected
            or (OUT_DIR / name).read_text() != expected[name]
        )
        if stale:
            print(f"stale dashboards {stale}: run `make dashboards`", file=sys.stderr)
            return 1
        return 0
    OUT_DIR.mkdir(exist_ok=True)
    for name, text in expected.items():
        (OUT_DIR / name).write_text(text)
    print(f"wrote {len(expected)} dashboards to {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
