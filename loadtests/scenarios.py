"""The benchmark matrix (`make bench`): named presets, each run by the load generator against a
private mesh on free ports (1 gateway, 1 worker, so every hop shares one engine), the engine
in-process with the mesh down, and vLLM's own OpenAI server.

transport  every hop on the same engine: worker, Envoy -> worker, gateway -> Envoy -> worker,
           edge -> gateway -> Envoy -> worker; TTFT/ITL per hop and tokens/s at 1..128 streams
engine     vLLM in-process (no gRPC), same model and settings; the mesh's share of it
rest       REST/JSON through Envoy's transcoder vs gRPC at the edge: tokens/s, TTFT p99,
           bytes on the wire per token
sse        the same against vLLM's OpenAI server (SSE), with the mesh down
versus     edge gRPC, edge REST and vLLM's SSE server up together, in interleaved rounds (the
           fair comparison on a shared machine: every path sees the same load)
cost       the same two, 1/32/64 streams of 128 tokens: CPU µs per token of every process from
           /proc, TTFT and ITL, py-spy profiles of the worker and gateway (loadtests/token_cost.py)
many       1,000 concurrent Generate streams on one client channel through the edge
slow       100 streams read one token a second beside full-speed streams: their ITL, and RSS
degraded   open-loop load with documents; the reranker is stopped halfway: TTFT step, errors
prefix     2 workers on a larger model: least_request against prefix-aware routing, interleaved
           rounds of shared-prefix, uniform and skewed prompts (loadtests/prefix_routing.py)

Results: loadtests/results/<date>/ (one JSON per run, summary.md, PNG plots).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from loadtests import report
from loadtests.runner import RunConfig, combine, run
from loadtests.stats import Latencies
from tokenmesh.common.cpu_pinning import pin_threads
from tokenmesh.common.processes import stop_process
from tokenmesh.localmesh.mesh import LocalMesh, LocalMeshSettings
from tokenmesh.localmesh.probes import free_port
from tokenmesh.worker.placement import place_engine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "models/tiny-llama"
CONCURRENCY = (1, 8, 32, 64, 128)
QUICK_CONCURRENCY = (1, 8)
ORDER = (
    "transport", "rest", "many", "slow", "degraded", "engine", "sse", "versus", "cost", "prefix",
)  # fmt: skip
MESH_SCENARIOS = ("transport", "rest", "many", "slow", "degraded")


class Bench:
    """Runs and records one scenario's load-generator runs."""

    def __init__(self, out: Path, quick: bool) -> None:
        self.out = out
        self.quick = quick
        # Comparisons run as interleaved rounds of this many seconds each.
        self.round_count = 1 if quick else 2
        self.round_seconds = 2.0 if quick else 5.0
        self.results: dict[str, list[dict[str, Any]]] = {}
        self.notes: dict[str, Any] = {}

    def config(self, **values: Any) -> RunConfig:
        base: dict[str, Any] = {
            "duration": 2.0 if self.quick else 8.0,
            "warmup": 0.5 if self.quick else 2.0,
            "requests": 200 if self.quick else 5000,
            "prompt_words": "16",
            "output_tokens": "16" if self.quick else "64",
            "seed": 1,
        }
        return RunConfig(**{**base, **values})

    def run(self, scenario: str, config: RunConfig) -> dict[str, Any]:
        return self.rounds(scenario, [config], 1)[0]

    def rounds(self, scenario: str, configs: list[RunConfig], rounds: int) -> list[dict[str, Any]]:
        """Each config `rounds` times, interleaved (A B C A B C ...) so that every target
        sees the same machine load on this shared machine; each config's rounds combined."""
        runs: dict[str, list[dict[str, Any]]] = {}
        for number in range(rounds):
            for config in configs:
                print(f"[{scenario}] {config.label} ({number + 1}/{rounds})", file=sys.stderr)
                runs.setdefault(config.label, []).append(run(replace(config, seed=number + 1)))
        return [self._record(scenario, combine(results)) for results in runs.values()]

    def _record(self, scenario: str, result: dict[str, Any]) -> dict[str, Any]:
        config = result["config"]
        name = config["label"].replace(" ", "_").replace("/", "-").replace(">", "")
        report.write_json(result, self.out / scenario / f"{name}.json")
        self.results.setdefault(scenario, []).append(result)
        print(
            f"[{scenario}] {config['label']}: {result['requests']} requests, "
            f"{result['errors']} errors, {result['tokens_per_second']:,.0f} tokens/s, "
            f"TTFT p99 {result['ttft_ms']['p99_ms']} ms, load {result['load_average_start']}",
            file=sys.stderr,
            flush=True,
        )
        return result


@contextmanager
def private_mesh(**overrides: Any) -> Iterator[LocalMesh]:
    """1 gateway and 1 worker (every hop on the same engine), reranker, control plane, Envoy;
    other LocalMeshSettings in overrides (e.g. workers=2, model=...)."""
    with tempfile.TemporaryDirectory(prefix="loadtest-mesh-") as run_dir:
        settings = LocalMeshSettings.on_free_ports(
            Path(run_dir), **{"gateways": 1, "workers": 1, **overrides}
        )
        local_mesh = LocalMesh(settings, root=ROOT)
        try:
            if local_mesh.up() != 0:
                raise SystemExit("the mesh did not come up")
            yield local_mesh
        finally:
            local_mesh.down()


def hops(local_mesh: LocalMesh) -> list[tuple[str, str, str]]:
    """(label, target kind, address) for each path to the engine, shortest first."""
    s = local_mesh.settings
    return [
        ("worker", "worker", local_mesh.program("worker-0").address),
        ("envoy>worker", "worker", f"127.0.0.1:{s.worker_listener_port}"),
        ("gateway>envoy>worker", "llm", local_mesh.program("gateway-0").address),
        ("edge>gateway>envoy>worker", "llm", f"127.0.0.1:{s.edge_port}"),
    ]


def transport(bench: Bench, local_mesh: LocalMesh) -> None:
    concurrency = QUICK_CONCURRENCY if bench.quick else CONCURRENCY
    for c in concurrency:
        configs = [
            bench.config(
                target=kind,
                address=address,
                concurrency=c,
                processes=2 if c >= 32 else 1,
                duration=bench.round_seconds,
                label=f"{label} c={c}",
            )
            for label, kind, address in hops(local_mesh)
        ]
        bench.rounds("transport", configs, bench.round_count)


def rest(bench: Bench, local_mesh: LocalMesh) -> None:
    edge = f"127.0.0.1:{local_mesh.settings.edge_port}"
    for c in (8,) if bench.quick else (8, 32):
        configs = [
            bench.config(
                target=kind,
                address=edge,
                concurrency=c,
                duration=bench.round_seconds,
                label=f"{name} c={c}",
            )
            for kind, name in (("llm", "edge gRPC"), ("rest", "edge REST-JSON"))
        ]
        bench.rounds("rest", configs, bench.round_count)
    # Bytes on the wire: a separate, shorter run through the counting relay.
    for kind, name in (("llm", "edge gRPC"), ("rest", "edge REST-JSON")):
        bench.run(
            "rest",
            bench.config(
                target=kind,
                address=edge,
                concurrency=8,
                count_bytes=True,
                duration=3.0 if not bench.quick else 1.0,
                label=f"{name} bytes c=8",
            ),
        )


def many(bench: Bench, local_mesh: LocalMesh) -> None:
    streams = 100 if bench.quick else 1000
    bench.run(
        "many",
        bench.config(
            target="llm",
            address=f"127.0.0.1:{local_mesh.settings.edge_port}",
            concurrency=streams,
            requests=streams,
            processes=1,  # one process, one channel: every stream on one HTTP/2 connection
            warmup=0.0,
            duration=300.0,
            timeout=300.0,
            output_tokens="16",
            label=f"{streams} streams one channel",
        ),
    )


def rss(local_mesh: LocalMesh) -> dict[str, int]:
    names = ("gateway-0", "worker-0", "envoy")
    return {name: psutil.Process(local_mesh.pid(name)).memory_info().rss for name in names}


def slow(bench: Bench, local_mesh: LocalMesh) -> None:
    edge = f"127.0.0.1:{local_mesh.settings.edge_port}"
    # The slow readers take slow_tokens seconds; the fast streams run for as long.
    slow_tokens = 4 if bench.quick else 20
    base = bench.config(target="llm", address=edge, concurrency=8, duration=float(slow_tokens))
    bench.run("slow", replace(base, label="fast streams alone c=8 (before)"))
    before = rss(local_mesh)
    peak = dict(before)
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            for name, value in rss(local_mesh).items():
                peak[name] = max(peak[name], value)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        slow_streams = 10 if bench.quick else 100
        bench.run(
            "slow",
            replace(
                base,
                slow_streams=slow_streams,
                slow_interval=1.0,
                slow_tokens=slow_tokens,
                label=f"fast streams c=8 beside {slow_streams} slow readers",
            ),
        )
    finally:
        stop.set()
        sampler.join(5)
    after = rss(local_mesh)
    bench.run("slow", replace(base, label="fast streams alone c=8 (after)"))
    bench.notes["slow_rss_bytes"] = {"before": before, "peak": peak, "after": after}


def degraded(bench: Bench, local_mesh: LocalMesh) -> None:
    duration = 6.0 if bench.quick else 20.0
    config = bench.config(
        target="llm",
        address=f"127.0.0.1:{local_mesh.settings.edge_port}",
        mode="open",
        rate=4.0,
        documents=16,
        output_tokens="16",
        duration=duration,
        warmup=2.0,
        label="reranker stopped halfway",
    )
    reranker = local_mesh.pid("reranker")
    stopped_at: list[float] = []

    def stop_reranker() -> None:
        stopped_at.append(time.time())
        local_mesh.ctl(
            "stop", "reranker"
        )  # SIGTERM; supervisord does not restart a stopped program

    # The generator processes take a second or two to start; the kill time is recorded in
    # wall-clock time and placed on the run's timeline afterwards.
    started = time.time()
    timer = threading.Timer(3.0 + config.warmup + duration / 2, stop_reranker)
    timer.start()
    try:
        result = bench.run("degraded", config)
    finally:
        timer.cancel()
    bench.notes["degraded"] = phases(result, stopped_at[0] if stopped_at else None, started)
    bench.notes["degraded"]["reranker_pid"] = reranker


def phases(result: dict[str, Any], stopped_unix: float | None, started: float) -> dict[str, Any]:
    """TTFT before the reranker stopped, after it (before the circuit opened), and with the
    circuit open; each from its own HDR histogram of the run's timeline."""
    measure_origin = result["measure_origin_unix"]
    kill = stopped_unix - measure_origin if stopped_unix else None
    groups = {name: Latencies() for name in ("before", "after_before_open", "circuit_open")}
    first_open = None
    for start, ttft, _e2e, status, warning in result["timeline"]:
        if status != "OK" or ttft < 0:
            continue
        if kill is None or start < kill:
            groups["before"].record(ttft)
        elif "circuit open" in warning:
            groups["circuit_open"].record(ttft)
            first_open = start if first_open is None else min(first_open, start)
        else:
            groups["after_before_open"].record(ttft)
    return {
        "reranker_stopped_at_s": round(kill, 2) if kill is not None else None,
        "circuit_open_after_s": round(first_open - kill, 2) if first_open and kill else None,
        "ttft_ms": {name: latencies.percentiles() for name, latencies in groups.items()},
        "errors": result["errors"],
        "requests": result["requests"],
    }


def engine(bench: Bench) -> None:
    """vLLM in-process, in a subprocess (vLLM's own workers need a __main__ guard)."""
    out = bench.out / "engine" / "engine.json"
    batches = ",".join(str(c) for c in (QUICK_CONCURRENCY if bench.quick else CONCURRENCY))
    tokens = "16" if bench.quick else "64"
    command = [sys.executable, "-m", "loadtests.engine_bench", "--batches", batches,
               "--output-tokens", tokens, "--model", MODEL, "--out", str(out)]  # fmt: skip
    log = ROOT / ".run" / "engine-bench.log"
    log.parent.mkdir(exist_ok=True)
    print(f"[engine] vLLM in-process (log: {log})", file=sys.stderr, flush=True)
    with log.open("w") as output:
        subprocess.run(command, cwd=ROOT, check=True, timeout=900, stdout=output, stderr=output)
    bench.notes["engine"] = json.loads(out.read_text())


@contextmanager
def openai_server(
    placed: bool = False, api_servers: int = 1, engine_core: str = "0"
) -> Iterator[tuple[str, int]]:
    """vLLM's own OpenAI-compatible server on the tiny model, with a worker's settings: its
    address and process id. Placed: once up, its engine's processes keep to the engine's core
    and the server's own threads to the others, as a mesh worker places itself. api_servers:
    its --api-server-count (API-server processes over the one engine); engine_core: the core
    its engine's runner binds."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": engine_core}
    # Several API servers only through `vllm serve` (its older module runs one; vllm_serve.py).
    server = (
        ["loadtests.vllm_serve", MODEL, "--api-server-count", str(api_servers)]
        if api_servers > 1
        else ["vllm.entrypoints.openai.api_server", "--model", MODEL]
    )
    command = [sys.executable, "-m", *server,
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "2048", "--max-num-seqs", "256",
               # A worker's structured outputs (the local mesh's: xgrammar, compact JSON).
               "--structured-outputs-config",
               '{"backend": "xgrammar", "disable_any_whitespace": true}']  # fmt: skip
    log = ROOT / ".run" / f"vllm-openai{'-placed' if placed else ''}-{api_servers}.log"
    log.parent.mkdir(exist_ok=True)
    print(f"[sse] vLLM's OpenAI server on port {port} (log: {log})", file=sys.stderr, flush=True)
    with log.open("w") as output:
        # A session of its own, as the mesh's programs have under supervisord: each server
        # under test is scheduled apart from the benchmark and its generator.
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=output, stderr=output, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    raise SystemExit(f"vLLM's server exited ({process.returncode}); see {log}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        break
                except OSError:
                    time.sleep(1)
            else:
                raise SystemExit("vLLM's server did not come up in time")
            if placed:
                engine = place_engine("runner", process.pid)
                pin_threads(frozenset(os.sched_getaffinity(0)) - engine, process.pid)
            yield f"127.0.0.1:{port}", process.pid
        finally:
            stop_process(process, 60)


def sse(bench: Bench) -> None:
    with openai_server() as (address, _server):
        for c in (8,) if bench.quick else (8, 32):
            config = bench.config(
                target="openai",
                address=address,
                model="tiny",
                concurrency=c,
                duration=bench.round_seconds,
                label=f"vLLM OpenAI SSE c={c}",
            )
            bench.rounds("rest", [config], bench.round_count)
        bench.run(
            "rest",
            bench.config(
                target="openai", address=address, model="tiny", concurrency=8,
                count_bytes=True, duration=3.0 if not bench.quick else 1.0,
                label="vLLM OpenAI SSE bytes c=8",
            ),
        )  # fmt: skip


def versus(bench: Bench) -> None:
    """gRPC and REST at the edge and vLLM's SSE server measured in interleaved rounds while
    both are up (only one is loaded at a time), so all three see the same machine load."""
    with private_mesh() as local_mesh, openai_server() as (address, _server):
        edge = f"127.0.0.1:{local_mesh.settings.edge_port}"
        paths = (
            ("llm", edge, "edge gRPC"),
            ("rest", edge, "edge REST-JSON"),
            ("openai", address, "vLLM OpenAI SSE"),
        )
        for c in (8,) if bench.quick else (8, 32):
            configs = [
                bench.config(
                    target=kind, address=where, model="tiny", concurrency=c,
                    duration=bench.round_seconds, label=f"{name} c={c}",
                )
                for kind, where, name in paths
            ]  # fmt: skip
            bench.rounds("versus", configs, bench.round_count + 1)
        for kind, where, name in paths:
            bench.run(
                "versus",
                bench.config(
                    target=kind, address=where, model="tiny", concurrency=8, count_bytes=True,
                    duration=3.0 if not bench.quick else 1.0, label=f"{name} bytes c=8",
                ),
            )  # fmt: skip


MESH_STEPS: dict[str, Callable[[Bench, LocalMesh], None]] = {
    "transport": transport,
    "rest": rest,
    "many": many,
    "slow": slow,
    "degraded": degraded,
}


def bench_command(names: str, quick: bool, out: Path | None) -> int:
    chosen = ORDER if names == "all" else tuple(n.strip() for n in names.split(","))
    unknown = set(chosen) - set(ORDER)
    if unknown:
        raise SystemExit(f"unknown scenarios {sorted(unknown)}; known: {', '.join(ORDER)}")
    stamp = datetime.now(UTC).strftime("%Y-%m-%d")
    bench = Bench(out or RESULTS / (stamp + ("-quick" if quick else "")), quick)
    bench.out.mkdir(parents=True, exist_ok=True)
    machine = {
        "cpus": os.cpu_count(),
        **report.processor(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_at_start": [round(v, 2) for v in os.getloadavg()],
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "quick": quick,
    }
    if any(name in MESH_SCENARIOS for name in chosen):
        with private_mesh() as local_mesh:
            for name in ORDER:
                if name in chosen and name in MESH_SCENARIOS:
                    MESH_STEPS[name](bench, local_mesh)
    # With the mesh down: the engine alone, then vLLM's own server (one engine at a time).
    if "engine" in chosen:
        engine(bench)
    if "sse" in chosen:
        sse(bench)
    if "versus" in chosen:
        versus(bench)
    if "cost" in chosen:
        from loadtests.token_cost import cost

        bench.notes["cost"] = cost(bench, bench.round_count + 1, profile=not quick)["comparisons"]
    if "prefix" in chosen:
        from loadtests.prefix_routing import prefix_routing

        bench.notes["prefix"] = prefix_routing(bench, bench.round_count + 1)["targets"]
    machine["load_average_at_end"] = [round(v, 2) for v in os.getloadavg()]
    notes_file = bench.out / "notes.json"
    # A later run of some scenarios into the same directory keeps the earlier runs' notes.
    earlier = json.loads(notes_file.read_text()) if notes_file.exists() else {}
    if earlier.get("machine"):
        machine = {**earlier["machine"], f"{'+'.join(chosen)}_run": machine}
    notes_file.write_text(json.dumps({**earlier, "machine": machine, **bench.notes}, indent=1))
    from loadtests.summary import write_summary

    write_summary(bench.out)
    print(f"results in {bench.out}", file=sys.stderr)
    return 0
