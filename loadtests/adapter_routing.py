"""Adapter-aware routing (issue #35) measured: 8 LoRA adapters asked for round-robin over 2
workers whose engines batch 2 adapters at a time (max_loras) and hold 4 (max_cpu_loras), through
an Envoy that routes by the gateway's affinity key (prefix: an adapter's requests share its key,
docs/decisions/0033) and one that routes by least request, in front of the same gateway and
workers.

A private mesh of 1 gateway and 2 workers on the tiny model with 8 generated adapters (distinct
random weights, scripts/make_tiny_lora.py), and a second Envoy per policy started and placed
alike (tests/harness/meshes.py, second_envoy). Closed-loop load, one edge at a time, in
interleaved rounds whose order alternates (A B, B A, ...); each round sends `--requests`
streamed completions of `--tokens` tokens, `--concurrency` at a time, adapter i % 8 for the
i-th, every prompt its own. The workers' adapter caches carry over from one round to the next,
whichever edge ran it: each round's first requests find what the other edge's round left.

Per policy: adapter loads and evictions per minute (the workers' own counters), TTFT p50/p99,
tokens/s, each worker's share of the requests, CPU per token of each process from /proc.

    python -m loadtests.adapter_routing [--rounds 3] [--requests 96] [--concurrency 8]
        [--tokens 32] [--out DIR]

Results: loadtests/results/<date>/adapter-routing/ (result.json, README.md). All traffic goes
to 127.0.0.1; every round is bounded in requests and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

from loadtests.scenarios import RESULTS, ROOT, private_mesh
from loadtests.stats import Latencies
from loadtests.token_cost import cpu_seconds
from tests.harness.meshes import environment, second_envoy
from tokenmesh.localmesh.mesh import LocalMesh, envoy_hosts
from tokenmesh.worker.placement import descendants

SCENARIO = "adapter-routing"
ADAPTERS = 8
WORKERS = 2
# Adapters in one batch, and held by an engine: both under the 8 asked for (the case;
# --max-loras and --max-cpu-loras change them).
MAX_LORAS, MAX_CPU_LORAS = 2, 4
POLICIES = ("prefix", "least_request")
# A round's bound, whatever the machine does.
ROUND_SECONDS = 300.0


@dataclass(frozen=True)
class Edge:
    policy: str
    port: int
    admin_port: int
    pid: int


def make_adapters(directory: Path) -> dict[str, str]:
    """ADAPTERS adapters of the tiny model, each of its own random weights: {name: path}."""
    made = {}
    for i in range(ADAPTERS):
        path = directory / f"adapter-{i}"
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "make_tiny_lora.py"),
             str(ROOT / "models" / "tiny-llama"), str(path), "--seed", str(1000 + i)],
            check=True, capture_output=True,
        )  # fmt: skip
        made[f"adapter-{i}"] = str(path)
    return made


def counters(local_mesh: LocalMesh) -> dict[str, dict[str, float]]:
    """Each worker's adapter loads and evictions (all adapters) and finished requests."""
    found = {}
    for worker in local_mesh.replicas("worker"):
        url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        values = {"loads": 0.0, "evictions": 0.0, "requests": 0.0, "load_seconds": 0.0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "tokenmesh_worker_adapter_loads_total":
                    values["loads"] += sample.value
                elif sample.name == "tokenmesh_worker_adapter_load_seconds_sum":
                    values["load_seconds"] += sample.value
                elif sample.name == "tokenmesh_worker_adapter_evictions_total":
                    values["evictions"] += sample.value
                elif sample.name == "vllm:request_success_total":
                    values["requests"] += sample.value
        found[worker.name] = values
    return found


async def one(
    client: openai.AsyncOpenAI, adapter: str, prompt: str, tokens: int
) -> tuple[float, int]:
    """A streamed completion: seconds to its first text, and the tokens it carried."""
    begun = time.perf_counter()
    first, count = None, 0
    stream = await client.completions.create(
        model=adapter,
        prompt=prompt,
        max_tokens=tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - begun
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
    if first is None:
        raise RuntimeError(f"{adapter}: a stream with no text")
    return first, count


async def load(
    edge: Edge, label: str, requests: int, concurrency: int, tokens: int
) -> dict[str, Any]:
    """One round through one edge: TTFTs, tokens and seconds."""
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{edge.port}/v1", api_key="-", max_retries=0, timeout=120
    )
    queue = list(range(requests))
    ttft, total = Latencies(), 0

    async def loop() -> None:
        nonlocal total
        while queue:
            i = queue.pop(0)
            seconds, count = await one(
                client, f"adapter-{i % ADAPTERS}", f"{label} request {i}: tell me more", tokens
            )
            ttft.record(seconds)
            total += count

    begun = time.perf_counter()
    async with client:
        await asyncio.wait_for(asyncio.gather(*(loop() for _ in range(concurrency))), ROUND_SECONDS)
    return {"seconds": time.perf_counter() - begun, "tokens": total, "ttft": ttft}


def processes(local_mesh: LocalMesh, edge: Edge) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {"envoy": [edge.pid], "gateway": [local_mesh.pid("gateway-0")]}
    for worker in local_mesh.replicas("worker"):
        pid = local_mesh.pid(worker.name)
        found[worker.name] = [pid, *descendants(pid)]
    return found


def measured(
    local_mesh: LocalMesh, edge: Edge, label: str, args: argparse.Namespace
) -> dict[str, Any]:
    pids = processes(local_mesh, edge)
    cpu_before = {name: cpu_seconds(ids) for name, ids in pids.items()}
    before = counters(local_mesh)
    figures = asyncio.run(load(edge, label, args.requests, args.concurrency, args.tokens))
    after = counters(local_mesh)
    cpu = {name: cpu_seconds(ids) - cpu_before[name] for name, ids in pids.items()}
    minutes = figures["seconds"] / 60
    delta = {
        name: {key: after[name][key] - before[name][key] for key in after[name]} for name in after
    }
    tokens = figures["tokens"]
    return {
        "policy": edge.policy,
        "seconds": round(figures["seconds"], 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / figures["seconds"], 1),
        "ttft_ms": figures["ttft"].summary(),
        "loads_per_minute": round(sum(d["loads"] for d in delta.values()) / minutes, 1),
        "evictions_per_minute": round(sum(d["evictions"] for d in delta.values()) / minutes, 1),
        # The engines' time spent loading adapters (each load stops its engine's steps).
        "load_seconds": round(sum(d["load_seconds"] for d in delta.values()), 2),
        "mean_load_ms": round(
            1000
            * sum(d["load_seconds"] for d in delta.values())
            / max(1.0, sum(d["loads"] for d in delta.values())),
            1,
        ),
        "requests_by_worker": {name: d["requests"] for name, d in delta.items()},
        "cpu_us_per_token": {
            name: round(seconds / tokens * 1e6, 1) for name, seconds in cpu.items()
        },
    }


def summary(rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    by_policy: dict[str, dict[str, Any]] = {}
    for policy in POLICIES:
        mine = [r for r in rounds if r["policy"] == policy]
        by_policy[policy] = {
            "loads_per_minute": [r["loads_per_minute"] for r in mine],
            "mean_load_ms": [r["mean_load_ms"] for r in mine],
            "load_seconds": [r["load_seconds"] for r in mine],
            "ttft_p50_ms": [r["ttft_ms"]["p50_ms"] for r in mine],
            "ttft_p99_ms": [r["ttft_ms"]["p99_ms"] for r in mine],
            "tokens_per_s": [r["tokens_per_s"] for r in mine],
            "requests_by_worker": [r["requests_by_worker"] for r in mine],
            "cpu_us_per_token": [r["cpu_us_per_token"] for r in mine],
        }
    return by_policy


def markdown(
    by_policy: dict[str, dict[str, Any]], args: argparse.Namespace, engine_args: dict[str, int]
) -> str:
    def span(values: list[float]) -> str:
        return f"{min(values):,.0f}\u2013{max(values):,.0f}" if values else "-"

    lines = [
        f"# Adapter-aware routing against least request ({datetime.now(UTC).date()})",
        "",
        f"`python -m loadtests.adapter_routing --rounds {args.rounds} --requests "
        f"{args.requests} --concurrency {args.concurrency} --tokens {args.tokens} --max-loras "
        f"{args.max_loras} --max-cpu-loras {args.max_cpu_loras}`: {ADAPTERS} adapters "
        f"round-robin, 2 workers with {engine_args}; each cell the range "
        "over the rounds.",
        "",
        "| policy | adapter loads / min | mean load ms | TTFT p50 ms | TTFT p99 ms | tokens/s "
        "| workers' CPU µs per token |",
        "|---|---|---|---|---|---|---|",
    ]
    for policy, figures in by_policy.items():
        workers = [
            sum(v for k, v in cpu.items() if k.startswith("worker"))
            for cpu in figures["cpu_us_per_token"]
        ]
        lines.append(
            f"| {policy} | {span(figures['loads_per_minute'])} "
            f"| {span(figures['mean_load_ms'])} | {span(figures['ttft_p50_ms'])} "
            f"| {span(figures['ttft_p99_ms'])} | {span(figures['tokens_per_s'])} "
            f"| {span(workers)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--max-loras", type=int, default=MAX_LORAS)
    parser.add_argument("--max-cpu-loras", type=int, default=MAX_CPU_LORAS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    engine_args = {"max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras}
    out = args.out or RESULTS / str(datetime.now(UTC).date()) / SCENARIO
    with (
        tempfile.TemporaryDirectory(prefix="adapters-") as made,
        environment({"TOKENMESH_WORKER_ENGINE_ARGS": json.dumps(engine_args)}),
        private_mesh(workers=WORKERS, lora_modules=make_adapters(Path(made))) as local_mesh,
        ExitStack() as stack,
    ):
        edges = []
        for policy in POLICIES:
            settings, pid = stack.enter_context(
                second_envoy(local_mesh, local_mesh.run_dir, worker_routing=policy)
            )
            edges.append(Edge(policy, settings.edge_port, settings.admin_port, pid))
        for edge in edges:
            deadline = time.monotonic() + 60
            while sum(ok for _, ok in envoy_hosts(edge.admin_port).get("worker", [])) < WORKERS:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{edge.policy}: no {WORKERS} healthy workers in 60 s")
                time.sleep(0.5)
        rounds = []
        for number in range(args.rounds):
            for edge in edges if number % 2 == 0 else edges[::-1]:
                result = measured(local_mesh, edge, f"round {number} {edge.policy}", args)
                print(json.dumps(result), flush=True)
                rounds.append(result)
    by_policy = summary(rounds)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(
        json.dumps({"rounds": rounds, "summary": by_policy, "engine_args": engine_args}, indent=1)
    )
    text = markdown(by_policy, args, engine_args)
    (out / "README.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
