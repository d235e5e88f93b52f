"""The cost of a token: the 1-gateway/1-worker mesh's edge (gRPC) against vLLM's own OpenAI SSE
server on the same model and core binding, both up, in interleaved rounds at 1, 32 and 64
streams of 128 tokens: tokens/s, TTFT and client ITL p50/p99, and CPU microseconds per
delivered token of each process (worker, engine, gateway, Envoy; vLLM's API server and engine),
read from /proc before and after each round. Beside them: the same services behind a second
Envoy on the other token path (the mesh's own edge has the direct token path by default:
gateways prepare, Envoy streams from the workers; the second one the gateway path, or with
--relay the direct path through the edge's stream relay), and at 32
and 64 streams the edge with stream_interval 8, and a second vLLM server placed as the mesh
places a worker (its engine's processes on the engine's core, the server's threads on the
others; --no-placed-baseline leaves it out). With --profile, py-spy samples the worker and
the gateway during an extra gRPC round, and the report lists where their time goes. On the
edge's own path (the direct token path) each request carries its own x-request-id, and the
report splits its first token's wait by stage, p50 and p99 (loadtests/first_token_stages.py):
arrival at the edge → prepared → sent to the worker → the worker's first message → first byte
at Envoy → first byte to the caller, beside the client's TTFT and vLLM's own.

    python -m loadtests.token_cost [--quick] [--rounds 3] [--profile] [--relay] [--out DIR]
    python -m loadtests bench --scenarios cost

All traffic goes to 127.0.0.1; every run is bounded in duration and request count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from loadtests import first_token_stages, report
from loadtests.profiles import profile_services
from loadtests.runner import RunConfig, combine, run
from loadtests.scenarios import (
    RESULTS,
    Bench,
    openai_server,
    private_mesh,
)
from tests.harness.meshes import environment, second_envoy
from tokenmesh.localmesh.mesh import LocalMesh
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.placement import descendants

CONCURRENCY = (1, 32, 64)
QUICK_CONCURRENCY = (1, 32)
OPENAI_CONCURRENCY = (8, 32, 64)
OUTPUT_TOKENS = "128"
# vLLM's server with its engine's processes on the engine's core and its own threads on the
# other, as the mesh places a worker: the same placement on both sides of the comparison.
PLACED_SSE = "vLLM OpenAI SSE, placed as the mesh"
# The stream_interval of the extra throughput-mode runs.
INTERVAL = 8
# --structured: one schema for every request (each engine compiles it once, then caches it),
# whose string the random model fills to max_tokens: every token sampled under the grammar.
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}
STRUCTURED_CONCURRENCY = (8, 32)
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes (every thread), from /proc/<pid>/stat."""
    total = 0
    for process in pids:
        try:
            fields = Path(f"/proc/{process}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        # utime and stime are fields 14 and 15 of stat; [0] here is field 3 (state).
        total += int(fields[11]) + int(fields[12])
    return total / TICKS


@dataclass(frozen=True)
class Route:
    """One way to the engine: a target for the load generator and the processes it runs on."""

    label: str
    target: str
    address: str
    model: str
    processes: dict[str, list[int]]
    # Processes split over this many hops (Envoy serves the edge and the worker hop).
    hops: dict[str, int]
    # Services whose own TTFT histogram (tokenmesh_ttft_seconds) is read: their metrics ports.
    metrics: dict[str, int] = field(default_factory=dict)
    # The requests' stream_interval (tokenmesh only; 0: every token at once).
    interval: int = 0
    # The JSON schema every answer follows (openai targets; "": plain text).
    structured_json: str = ""
    # Histograms read around each run (first_token_stages.HISTOGRAMS' names): metrics port
    # and metric.
    histograms: dict[str, tuple[int, str]] = field(default_factory=dict)
    # The edge Envoy's access log, on the direct token path: each request carries its own
    # x-request-id, and its line places the first token's stages (first_token_stages).
    access_log: Path | None = None
    # The worker's log: its RPC log line of each request places its handler's start.
    worker_log: Path | None = None


# The mesh's own edge (its token path as configured) and a second Envoy on the other path.
MESH_LABEL = "edge gRPC"
PATH_LABELS = {True: "edge gRPC, direct token path", False: "edge gRPC, gateway path"}
RELAY_LABEL = "edge gRPC, stream relay"
# With --relay: the router on the direct path (the stream relay off) behind a second Envoy
# started as the relay's is.
ROUTER_LABEL = "edge gRPC, router, second Envoy"


def mesh_path(local_mesh: LocalMesh) -> Route:
    worker = local_mesh.pid("worker-0")
    return Route(
        label=MESH_LABEL,
        target="llm",
        address=f"127.0.0.1:{local_mesh.settings.edge_port}",
        model="",
        processes={
            "worker": [worker],
            "engine": descendants(worker),
            "gateway": [local_mesh.pid("gateway-0")],
            "envoy": [local_mesh.pid("envoy")],
        },
        hops={"envoy": 1 if local_mesh.settings.direct_token_path else 2},
        metrics={
            name: program.metrics_port
            for name, program in (
                ("worker", local_mesh.program("worker-0")),
                ("gateway", local_mesh.program("gateway-0")),
            )
            if program.metrics_port is not None
        },
        histograms={
            name: (program.metrics_port, metric)
            for name, (service, metric) in first_token_stages.HISTOGRAMS.items()
            if (program := local_mesh.program(f"{service}-0")).metrics_port is not None
        },
        access_log=(
            local_mesh.log_dir / "envoy.log" if local_mesh.settings.direct_token_path else None
        ),
        worker_log=local_mesh.log_dir / "worker-0.log",
    )


def openai_path(mesh: Route, local_mesh: LocalMesh) -> Route:
    """The same mesh's edge speaking OpenAI's SSE (the gateway's HTTP API behind Envoy)."""
    return replace(
        mesh, label="edge OpenAI SSE", target="openai", model=Path(local_mesh.settings.model).name
    )


def other_path(mesh: Route, envoy: MeshSettings, envoy_pid: int) -> Route:
    """The same gateway and worker behind a second Envoy on the other token path: with the
    direct token path the gateway prepares each request and Envoy streams the worker's tokens
    to the caller (one Envoy hop); without it every token passes through the gateway (two)."""
    return replace(
        mesh,
        label=RELAY_LABEL if envoy.relays else PATH_LABELS[envoy.direct_token_path],
        address=f"127.0.0.1:{envoy.edge_port}",
        processes={**mesh.processes, "envoy": [envoy_pid]},
        hops={"envoy": 1 if envoy.direct_token_path else 2},
        access_log=None,
    )


def structured(path: Route) -> Route:
    """The same OpenAI route, every answer bound to STRUCTURED_SCHEMA."""
    return replace(
        path, label=f"{path.label}, JSON schema", structured_json=json.dumps(STRUCTURED_SCHEMA)
    )


# A variant's mesh settings are named "mesh.<MeshSettings' name>"; the others are the worker's.
MESH_SETTING = "mesh."


def variant_setting(name: str) -> tuple[str, str]:
    """Whose setting a variant's name is ("mesh" or "worker"), and its own name there."""
    if name.startswith(MESH_SETTING):
        return "mesh", name.removeprefix(MESH_SETTING)
    return "worker", name


def variant_environment(settings: dict[str, str]) -> dict[str, str]:
    """The variables that set a variant's settings: TOKENMESH_MESH_* for "mesh.<name>",
    TOKENMESH_WORKER_* for a worker setting's name."""
    environment = {}
    for name, value in settings.items():
        service, setting = variant_setting(name)
        environment[f"TOKENMESH_{service.upper()}_{setting.upper()}"] = value
    return environment


@contextlib.contextmanager
def variant_mesh(settings: dict[str, str]) -> Iterator[LocalMesh]:
    """A private mesh with these worker or mesh settings (in the environment its supervisord
    and its Envoy config start with; the rest of the run keeps its own)."""
    stack = contextlib.ExitStack()
    with environment(variant_environment(settings)):
        local_mesh = stack.enter_context(private_mesh())
    with stack:
        yield local_mesh


def variant_path(local_mesh: LocalMesh, settings: dict[str, str]) -> Route:
    named = ", ".join("{} {}={}".format(*variant_setting(k), v) for k, v in settings.items())
    return replace(mesh_path(local_mesh), label=f"{MESH_LABEL}, {named}")


def interval_path(mesh: Route, interval: int) -> Route:
    """The same mesh, each request asking for messages of `interval` tokens (stream_interval)."""
    return replace(mesh, label=f"edge gRPC stream_interval={interval}", interval=interval)


def sse_path(address: str, server: int, placed: bool = False) -> Route:
    return Route(
        label=PLACED_SSE if placed else "vLLM OpenAI SSE",
        target="openai",
        address=address,
        model="tiny",
        processes={"api_server": [server], "engine": descendants(server)},
        hops={},
        # vLLM's own TTFT (its engine's arrival to first token), from its server's /metrics.
        histograms={"engine_ttft": (int(address.rsplit(":", 1)[1]), first_token_stages.VLLM_TTFT)},
    )


def ttft_totals(metrics_port: int) -> tuple[float, float, float]:
    """(sum of seconds, count, count over 1 s) of a service's tokenmesh_ttft_seconds."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    seconds = count = within_1s = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tokenmesh_ttft_seconds_sum":
                seconds = float(sample.value)
            elif sample.name == "tokenmesh_ttft_seconds_count":
                count = float(sample.value)
            elif sample.name == "tokenmesh_ttft_seconds_bucket" and sample.labels["le"] == "1.0":
                within_1s = float(sample.value)
    return seconds, count, count - within_1s


def measured_run(config: RunConfig, path: Route) -> dict[str, Any]:
    """One run, with the CPU each of the path's processes spent in it, and the TTFT each
    service measured itself (request in to first token out)."""
    before = {name: cpu_seconds(pids) for name, pids in path.processes.items()}
    ttft_before = {name: ttft_totals(port) for name, port in path.metrics.items()}
    histograms_before = histogram_buckets(path)
    log = first_token_stages.EdgeLog(path.access_log) if path.access_log else None
    worker_log = first_token_stages.LogTail(path.worker_log) if path.worker_log else None
    result = run(config, show_progress=False)
    after = {name: cpu_seconds(pids) for name, pids in path.processes.items()}
    histograms = histogram_buckets(path)
    result["histogram_buckets"] = {
        name: first_token_stages.difference(histograms[name], histograms_before[name])
        for name in histograms
    }
    if log is not None:
        ids = {row[0] for row in result["firsts"]}
        lines = log.times(ids)
        handlers = (
            first_token_stages.handler_starts(worker_log.lines(), ids) if worker_log else None
        )
        result["stage_rows"] = first_token_stages.joined(result["firsts"], lines, handlers)
    result["cpu_seconds"] = {name: after[name] - before[name] for name in before}
    result["server_ttft_totals"] = {
        name: [a - b for a, b in zip(ttft_totals(port), ttft_before[name], strict=True)]
        for name, port in path.metrics.items()
    }
    return result


def histogram_buckets(path: Route) -> dict[str, dict[float, float]]:
    """The cumulative bucket counts of the route's histograms, by their names."""
    return {
        name: first_token_stages.buckets(port, [metric])[metric]
        for name, (port, metric) in path.histograms.items()
    }


def per_token(result: dict[str, Any], path: Route) -> dict[str, Any]:
    """CPU µs per delivered token of each process (per hop for Envoy), and the generator's."""
    tokens = result["tokens_received"]
    if not tokens:
        return {}
    cost = {
        name: round(seconds * 1e6 / tokens, 1) for name, seconds in result["cpu_seconds"].items()
    }
    for name, hops in path.hops.items():
        cost[f"{name}_per_hop"] = round(cost[name] / hops, 1)
    return cost


def summary_row(result: dict[str, Any], path: Route, concurrency: int) -> dict[str, Any]:
    return {
        "path": path.label,
        "streams": concurrency,
        "requests": result["requests"],
        "errors": result["errors"],
        "tokens_per_second": result["tokens_per_second"],
        "ttft_ms": {k: result["ttft_ms"].get(k) for k in ("p50_ms", "p99_ms")},
        "itl_ms": {k: result["itl_ms"].get(k) for k in ("p50_ms", "p99_ms")},
        "tokens_per_message": result.get("tokens_per_message"),
        # Each service's own mean TTFT (request in, first token out), beside the client's.
        "ttft_mean_ms": result["ttft_ms"].get("mean_ms"),
        "server_ttft_mean_ms": result.get("server_ttft_mean_ms"),
        "ttft_over_1s": result.get("ttft_over_1s"),
        "cpu_us_per_token": per_token(result, path),
        "generator_cpu_fraction": result["generator"]["cpu_fraction_per_process"],
        "load_average_per_round": result.get("load_average_per_round"),
        # Where the first token waited, by stage (first_token_stages), p50 and p99.
        "first_token_stages": result.get("first_token_stages"),
    }


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The mesh against the SSE server at one concurrency: ratios and the targets (and the
    ratios of the extra paths, when there are)."""
    mesh, sse = rows[0], rows[1]
    ratio = mesh["tokens_per_second"] / sse["tokens_per_second"] if sse["tokens_per_second"] else 0
    mesh_ttft, sse_ttft = mesh["ttft_ms"]["p50_ms"], sse["ttft_ms"]["p50_ms"]
    cost, peer = mesh["cpu_us_per_token"], sse["cpu_us_per_token"]
    interval = {
        f"{row['path']} tokens_per_second_ratio": round(
            row["tokens_per_second"] / sse["tokens_per_second"], 2
        )
        for row in rows[2:]
        if sse["tokens_per_second"]
    }
    for row in rows[2:]:
        if sse_ttft is not None and row["ttft_ms"]["p50_ms"] is not None:
            interval[f"{row['path']} ttft_p50_difference_ms"] = round(
                row["ttft_ms"]["p50_ms"] - sse_ttft, 1
            )
        if row["path"] == PLACED_SSE and row["tokens_per_second"]:
            # The mesh against vLLM's server placed as the mesh is.
            interval["tokens_per_second_ratio_vs_placed_sse"] = round(
                mesh["tokens_per_second"] / row["tokens_per_second"], 2
            )
            interval["worker_vs_placed_api_server_cpu"] = (
                round(cost["worker"] / row["cpu_us_per_token"]["api_server"], 2)
                if row["cpu_us_per_token"].get("api_server")
                else None
            )
    return {
        **interval,
        "tokens_per_second_ratio": round(ratio, 2),
        "ttft_p50_difference_ms": (
            round(mesh_ttft - sse_ttft, 1) if None not in (mesh_ttft, sse_ttft) else None
        ),
        "worker_vs_api_server_cpu": (
            round(cost["worker"] / peer["api_server"], 2) if peer.get("api_server") else None
        ),
        "engine_vs_engine_cpu": (
            round(cost["engine"] / peer["engine"], 2) if peer.get("engine") else None
        ),
    }


def markdown(rows: list[dict[str, Any]], comparisons: dict[str, Any]) -> str:
    lines = [
        "| path | streams | tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | tokens/msg | "
        "CPU µs per token | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cost = ", ".join(f"{name} {value}" for name, value in row["cpu_us_per_token"].items())
        lines.append(
            f"| {row['path']} | {row['streams']} | {row['tokens_per_second']:,.0f} | "
            f"{row['ttft_ms']['p50_ms']} / {row['ttft_ms']['p99_ms']} | "
            f"{row['itl_ms']['p50_ms']} / {row['itl_ms']['p99_ms']} | "
            f"{row['tokens_per_message'] or ''} | {cost} | {row['errors']} |"
        )
    lines.append("")
    for streams, comparison in comparisons.items():
        lines.append(f"- {streams} streams: {json.dumps(comparison)}")
    return "\n".join(lines) + "\n"


def cost(
    bench: Bench,
    rounds: int,
    profile: bool,
    concurrency: tuple[int, ...] | None = None,
    openai: bool = False,
    placed_baseline: bool = True,
    structured_outputs: bool = False,
    relay: bool = False,
    worker_variant: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Both servers up; each concurrency's runs interleaved, mesh then SSE, `rounds` times.
    With openai: the edge's OpenAI SSE first, then vLLM's, then the edge's gRPC, at 8, 32 and
    64 streams (results under openai/). With structured_outputs: the edge's OpenAI SSE and
    vLLM's, each plain and with STRUCTURED_SCHEMA, at 8 and 32 streams (under structured/).
    With worker_variant (worker settings by name, mesh settings as "mesh.<name>", e.g.
    {"gil_switch_interval_ms": "0.5"}): a second private mesh with them, its edge a path of its
    own beside the first's."""
    openai = openai or structured_outputs
    if concurrency is None:
        concurrency = OPENAI_CONCURRENCY if openai else CONCURRENCY
        concurrency = STRUCTURED_CONCURRENCY if structured_outputs else concurrency
        concurrency = QUICK_CONCURRENCY if bench.quick else concurrency
    name = "structured" if structured_outputs else "openai" if openai else "cost"
    rows: list[dict[str, Any]] = []
    comparisons: dict[str, Any] = {}
    with (
        private_mesh() as local_mesh,
        (
            contextlib.nullcontext((None, 0))
            if openai
            else second_envoy(
                local_mesh,
                local_mesh.run_dir,
                **(
                    # The direct path through the edge's stream relay (the default).
                    {"stream_relay": True, "direct_token_path": True}
                    if relay
                    else {"direct_token_path": not local_mesh.settings.direct_token_path}
                ),
            )
        ) as (other, other_pid),
        (
            # With the relay, the router behind a second Envoy too: an Envoy started as the
            # relay's is (its own session, outside supervisord's) is the like-for-like
            # baseline; the mesh's own Envoy was not (see the relay's cost record of
            # 2026-12-06).
            second_envoy(local_mesh, local_mesh.run_dir, stream_relay=False, direct_token_path=True)
            if relay and not openai
            else contextlib.nullcontext((None, 0))
        ) as (router, router_pid),
        variant_mesh(worker_variant) if worker_variant else contextlib.nullcontext(None) as variant,
        openai_server() as (address, server),
        openai_server(placed=True) if placed_baseline else contextlib.nullcontext(("", 0)) as (
            placed_address,
            placed_server,
        ),
    ):
        mesh = mesh_path(local_mesh)
        sse = sse_path(address, server)
        # The generator keeps off the engine's core, like the mesh's own processes.
        generator_cores = local_mesh.mesh_cores(
            local_mesh.settings.worker_count(), os.cpu_count() or 1
        )
        if structured_outputs:
            edge = openai_path(mesh, local_mesh)
            # First the pair compared (the mesh and vLLM, both with the schema), then plain.
            paths = [structured(edge), structured(sse), edge, sse]
        elif openai:
            paths = [openai_path(mesh, local_mesh), sse, mesh]
        else:
            assert other is not None
            paths = [mesh, sse, other_path(mesh, other, other_pid)]
            if variant is not None and worker_variant:
                paths.insert(2, variant_path(variant, worker_variant))
            if router is not None:
                paths.append(replace(other_path(mesh, router, router_pid), label=ROUTER_LABEL))
        if placed_baseline and not structured_outputs:
            paths.append(sse_path(placed_address, placed_server, placed=True))
        for c in concurrency:
            # Fewer, larger messages (a client that prefers throughput), beside the default.
            routes = paths + ([interval_path(mesh, INTERVAL)] if c > 1 and not openai else [])
            configs = [
                bench.config(
                    target=path.target,
                    address=path.address,
                    model=path.model,
                    concurrency=c,
                    processes=2 if c >= 32 else 1,
                    duration=bench.round_seconds,
                    output_tokens=OUTPUT_TOKENS,
                    stream_interval=path.interval,
                    structured_json=path.structured_json,
                    cpus=generator_cores,
                    label=f"{path.label} c={c}",
                    request_ids=path.access_log is not None,
                )
                for path in routes
            ]
            runs = interleaved(configs, routes, rounds, "cost")
            group = []
            for path in routes:
                combined = runs[path.label]
                bench._record(name, combined)
                group.append(summary_row(combined, path, c))
            rows.extend(group)
            comparisons[str(c)] = compare(group)
            print(markdown(group, {str(c): comparisons[str(c)]}), file=sys.stderr, flush=True)
            print(first_token_stages.markdown(group), file=sys.stderr, flush=True)
        report_: dict[str, Any] = {
            # The path of the mesh's own edge ("edge gRPC"); the second Envoy has the other.
            "mesh_token_path": "direct" if local_mesh.settings.direct_token_path else "gateway",
            "rows": rows,
            "comparisons": comparisons,
            "profiles": None,
        }
        (bench.out / name).mkdir(parents=True, exist_ok=True)
        (bench.out / name / "cost.md").write_text(
            markdown(rows, comparisons)
            + "\nWhere the first token waits, by stage (p50 / p99 ms):\n\n"
            + first_token_stages.markdown(rows)
        )
        report.write_json(report_, bench.out / name / "summary.json")
        if profile:
            config = bench.config(
                target=mesh.target, address=mesh.address, concurrency=32, processes=2,
                duration=bench.round_seconds, output_tokens=OUTPUT_TOKENS, label="profiled c=32",
            )  # fmt: skip
            services = {name: mesh.processes[name][0] for name in ("worker", "gateway")}
            report_["profiles"] = profile_services(
                config, services, bench.round_seconds + 4, bench.out / "cost" / "profiles"
            )
            report.write_json(report_, bench.out / name / "summary.json")
    return report_


def interleaved(
    configs: list[RunConfig], routes: list[Route], rounds: int, tag: str
) -> dict[str, dict[str, Any]]:
    """Each route's run `rounds` times, interleaved (A B C A B C ...) so that every route sees
    the same machine load; each route's rounds combined, by its label."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for number in range(rounds):
        for config, route in zip(configs, routes, strict=True):
            print(f"[{tag}] {config.label} ({number + 1}/{rounds})", file=sys.stderr)
            result = measured_run(replace(config, seed=number + 1), route)
            runs.setdefault(route.label, []).append(result)
    return {label: combined_run(results) for label, results in runs.items()}


def combined_run(results: list[dict[str, Any]]) -> dict[str, Any]:
    combined = combine(results)
    cpu: Counter[str] = Counter()
    for result in results:
        cpu.update(result["cpu_seconds"])
    combined["cpu_seconds"] = dict(cpu)
    combined["cpu_seconds_per_round"] = [r["cpu_seconds"] for r in results]
    ttft: dict[str, list[float]] = {}
    for result in results:
        for name, figures in result.get("server_ttft_totals", {}).items():
            total = ttft.setdefault(name, [0.0, 0.0, 0.0])
            for position, value in enumerate(figures):
                total[position] += value
    combined["server_ttft_mean_ms"] = {
        name: round(1000 * total / count, 1) for name, (total, count, _) in ttft.items() if count
    }
    # First tokens that took a service over 1 s, beside the client's own count.
    combined["ttft_over_1s"] = {name: int(over) for name, (_, _, over) in ttft.items()}
    combined["ttft_over_1s"]["client"] = sum(1 for row in combined["timeline"] if row[1] > 1.0)
    # The first token's stages over every round's joined requests, and the histograms'.
    counts: dict[str, Counter[float]] = {}
    for result in results:
        for metric, buckets in result.get("histogram_buckets", {}).items():
            counts.setdefault(metric, Counter()).update(buckets)
    stage_rows = [row for result in results for row in result.get("stage_rows", [])]
    if stage_rows or counts:
        firsts = sum(len(result.get("firsts", [])) for result in results)
        combined["first_token_stages"] = {
            **first_token_stages.summary(stage_rows, firsts),
            "histograms": first_token_stages.histogram_summary(counts),
        }
    for key in ("firsts", "stage_rows", "histogram_buckets"):
        combined.pop(key, None)
    messages = sum(r.get("messages_received", 0) for r in results)
    if messages:
        combined["tokens_per_message"] = round(combined["tokens_received"] / messages, 2)
    return combined


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short rounds (a smoke test)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per target")
    parser.add_argument("--profile", action="store_true", help="py-spy the worker and gateway")
    parser.add_argument("--out", type=Path, default=None, help="result directory")
    parser.add_argument("--streams", default="", help="e.g. 32,64 (default: 1,32,64)")
    parser.add_argument(
        "--openai", action="store_true", help="the edge's OpenAI API against vLLM's (8,32,64)"
    )
    parser.add_argument(
        "--structured",
        action="store_true",
        help="structured output's cost: OpenAI SSE plain and with a JSON schema, edge and vLLM",
    )
    parser.add_argument(
        "--relay",
        action="store_true",
        help="the second Envoy on the direct path through the stream relay (stream_relay), "
        "instead of on the other token path",
    )
    parser.add_argument(
        "--no-placed-baseline",
        action="store_true",
        help="skip the second vLLM server placed as the mesh (engine core pinned)",
    )
    parser.add_argument(
        "--worker-variant",
        action="append",
        default=[],
        metavar="SETTING=VALUE",
        help="a second mesh whose worker has this setting (WorkerSettings' name), its edge "
        "measured beside the first's in the same rounds; repeatable",
    )
    parser.add_argument(
        "--mesh-variant",
        action="append",
        default=[],
        metavar="SETTING=VALUE",
        help="the second mesh with this mesh setting (MeshSettings' name, e.g. "
        "stream_relay=false), beside or with --worker-variant; repeatable",
    )
    args = parser.parse_args()
    variant = dict(item.split("=", 1) for item in args.worker_variant)
    if unknown := set(variant) - set(WorkerSettings.model_fields):
        parser.error(f"--worker-variant: {sorted(unknown)} are not worker settings")
    mesh_variant = dict(item.split("=", 1) for item in args.mesh_variant)
    if unknown := set(mesh_variant) - set(MeshSettings.model_fields):
        parser.error(f"--mesh-variant: {sorted(unknown)} are not mesh settings")
    variant |= {MESH_SETTING + k: v for k, v in mesh_variant.items()}
    streams = tuple(int(n) for n in args.streams.split(",")) if args.streams else None
    stamp = datetime.now(UTC).strftime("%Y-%m-%d")
    bench = Bench(args.out or RESULTS / (stamp + ("-quick" if args.quick else "")), args.quick)
    started = time.strftime("%F %T")
    result = cost(
        bench,
        args.rounds,
        args.profile,
        streams,
        args.openai,
        not args.no_placed_baseline,
        args.structured,
        args.relay,
        variant or None,
    )
    name = "structured" if args.structured else "openai" if args.openai else "cost"
    result["machine"] = {
        "cpus": os.cpu_count(),
        **report.processor(),
        "started_at": started,
        "load_average_at_end": [round(v, 2) for v in os.getloadavg()],
    }
    report.write_json(result, bench.out / name / "summary.json")
    print((bench.out / name / "cost.md").read_text())
    print(f"results in {bench.out / name}", file=sys.stderr)


if __name__ == "__main__":
    main()
