"""The dashboards and alert rules against the real mesh: the mesh's Prometheus (its config
generated from LocalMeshSettings) scrapes every service and Envoy while healthy, cancelled and
degraded traffic flows through the edge; every panel's query must return data."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from grpc import aio

from tests.support import RELAY_SERIES, ROOT, metric_value, positions, scrape_metrics
from tokenmesh.localmesh.mesh import LocalMesh
from tokenmesh.localmesh.probes import serving
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, llm_pb2, llm_pb2_grpc, token_pb2

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="no prometheus on PATH: `make setup` installs the Debian package as root",
    ),
]

DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
DOCUMENTS = ["Paris is in France.", "Bananas are yellow.", "The sea is salty.", "Rome is old."]
# What Grafana puts in place of its built-in and template variables: a rate window of several
# scrapes, and "All" (any value) for every variable.
RATE_INTERVAL = "1m"
CIRCUIT_OPEN = 2.0


def prometheus_query(local_mesh: LocalMesh, expr: str) -> dict[str, Any]:
    """The /api/v1/query answer for expr evaluated now (status, data or error)."""
    url = f"{local_mesh.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return dict(json.load(reply))
    except urllib.error.HTTPError as err:  # 400/422: a bad expression, with its error
        return dict(json.load(err))


def series(local_mesh: LocalMesh, expr: str) -> list[dict[str, Any]]:
    answer = prometheus_query(local_mesh, expr)
    assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
    return list(answer["data"]["result"])


def substitute(expr: str) -> str:
    """expr as Grafana sends it with every variable at All."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def wait_until(condition: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {within}s"
        time.sleep(0.5)


def circuit_states(local_mesh: LocalMesh) -> list[float]:
    return [
        metric_value(scrape_metrics(program.metrics_port or 0), "tokenmesh_reranker_circuit_state")
        for program in local_mesh.programs
        if program.service == "gateway"
    ]


async def generate(edge: llm_pb2_grpc.LLMServiceStub, i: int) -> int:
    request = llm_pb2.GenerateRequest(
        prompt=f"dashboards {i}", max_tokens=16, documents=DOCUMENTS, top_k_documents=2
    )
    return len(positions([token async for token in edge.Generate(request, timeout=60)]))


async def answer(edge: llm_pb2_grpc.LLMServiceStub, i: int) -> llm_pb2.Answer:
    # ignore_eos: the random tiny model ends a sampled answer at its first token now and then
    # (1 in ~2,000 tokens is its EOS), and an answer here must have text.
    query = llm_pb2.Query(
        prompt=f"which {i}?", max_tokens=8, documents=DOCUMENTS, top_k_documents=2, ignore_eos=True
    )
    return await edge.GetAnswer(query, timeout=60)


async def cancelled_stream(edge: llm_pb2_grpc.LLMServiceStub, i: int) -> None:
    request = llm_pb2.GenerateRequest(prompt=f"cancel {i}", max_tokens=1000, ignore_eos=True)
    call = edge.Generate(request, timeout=60)
    await call.read()
    call.cancel()


async def constrained(edge: llm_pb2_grpc.LLMServiceStub, i: int) -> str:
    """An answer that uses an engine feature (a structured output's choice)."""
    query = llm_pb2.Query(
        prompt=f"yes or no {i}?",
        max_tokens=4,
        structured_outputs=token_pb2.StructuredOutputs(choice=["yes", "no"]),
    )
    return (await edge.GetAnswer(query, timeout=60)).text


async def drive(edge: llm_pb2_grpc.LLMServiceStub, rounds: int) -> None:
    """Reranked streams and answers, streams the caller cancels, and constrained answers."""
    for round_ in range(rounds):
        i = round_ * 100
        await asyncio.gather(
            *(generate(edge, i + n) for n in range(6)),
            *(answer(edge, i + n) for n in range(4)),
            *(cancelled_stream(edge, i + n) for n in range(2)),
            constrained(edge, i),
        )


@pytest.fixture(scope="module")
async def scraped_traffic(mesh: LocalMesh) -> LocalMesh:
    """Healthy traffic, then a degraded period (reranker stopped until every gateway's circuit
    opens), then the reranker back and its circuits closed, all scraped by Prometheus."""
    async with aio.insecure_channel(f"127.0.0.1:{mesh.settings.edge_port}") as channel:
        edge = llm_pb2_grpc.LLMServiceStub(channel)
        await drive(edge, rounds=3)
        stopped = mesh.ctl("stop", "reranker")
        assert "stopped" in stopped.stdout, stopped.stdout + stopped.stderr
        try:
            for attempt in range(60):
                if min(circuit_states(mesh)) == CIRCUIT_OPEN:
                    break
                answers = await asyncio.gather(*(answer(edge, attempt * 10 + n) for n in range(4)))
                assert all(reply.text for reply in answers), "degraded answers still answer"
            assert min(circuit_states(mesh)) == CIRCUIT_OPEN, circuit_states(mesh)
            await drive(edge, rounds=1)  # degraded: served without the reranker
        finally:
            started = mesh.ctl("start", "reranker")
            assert "started" in started.stdout, started.stdout + started.stderr
        reranker = next(program for program in mesh.programs if program.name == "reranker")
        wait_until(lambda: serving(reranker.address), 180, "reranker SERVING again")
        wait_until(mesh.envoy_ready, 30, "Envoy sees the reranker healthy again")
        # After the open period a half-open probe goes through and closes each circuit.
        for attempt in range(60):
            if max(circuit_states(mesh)) == 0:
                break
            await asyncio.gather(*(answer(edge, attempt * 10 + n) for n in range(4)))
            await asyncio.sleep(0.5)
        assert max(circuit_states(mesh)) == 0, f"circuits not closed again: {circuit_states(mesh)}"
        await drive(edge, rounds=1)
    # Two scrapes after the last traffic, so every rate() window holds it.
    interval = mesh.settings.prometheus_scrape_interval_seconds
    wait_until(
        lambda: bool(
            series(mesh, f"changes(tokenmesh_reranker_circuit_state[{RATE_INTERVAL}]) > 0")
        ),
        10 * interval,
        "Prometheus scraped the circuit opening and closing",
    )
    await asyncio.sleep(2 * interval + 1)
    return mesh


def test_prometheus_scrapes_every_replica_and_envoy(mesh: LocalMesh) -> None:
    expected = {program.name for program in mesh.programs if program.metrics_port} | {"envoy"}

    def all_up() -> bool:
        found = {s["metric"]["replica"]: s["value"][1] for s in series(mesh, "up")}
        return set(found) == expected and set(found.values()) == {"1"}

    wait_until(all_up, 30, f"every target ({sorted(expected)}) scraped and up")
    jobs = {s["metric"]["job"] for s in series(mesh, "up")}
    assert jobs == {"gateway", "worker", "reranker", "controlplane", "envoy"}


def test_alert_rules_are_loaded_and_evaluate_without_errors(scraped_traffic: LocalMesh) -> None:
    url = f"{scraped_traffic.prometheus_url}/api/v1/rules"
    with urllib.request.urlopen(url, timeout=10) as reply:
        groups = json.load(reply)["data"]["groups"]
    rules = {rule["name"]: rule for group in groups for rule in group["rules"]}
    defined = yaml.safe_load((ROOT / "prometheus" / "alerts.yml").read_text())["groups"]
    assert set(rules) == {rule["alert"] for group in defined for rule in group["rules"]}
    broken = {name: rule.get("lastError") for name, rule in rules.items() if rule["health"] != "ok"}
    assert not broken, broken


# Series only a mesh with the edge's stream relay has (Envoy's stats of its module): the
# panels' queries of them alone are proven on such a mesh (test_stream_relay.py).
RELAY_ONLY = RELAY_SERIES + "resumption_gap"
# The workers' LoRA adapter series (tests/integration/test_adapters.py checks their panels).
ADAPTER_ONLY = "tokenmesh_worker_adapter_"


def panel_targets(only: str | None = None) -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) of every panel target: with `only` (RELAY_ONLY or
    ADAPTER_ONLY), those that query that feature's series; else those that query none of them
    (each feature's panels are checked on a mesh that has it)."""
    found = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                features = {f for f in (RELAY_ONLY, ADAPTER_ONLY) if f in target["expr"]}
                if features == ({only} if only else set()):
                    found.append((path.name, panel["title"], target["expr"]))
    return found


def test_every_panel_query_returns_series_from_the_live_mesh(scraped_traffic: LocalMesh) -> None:
    targets = panel_targets()
    assert len(targets) >= 30
    failures = []
    for dashboard, title, expr in targets:
        answer = prometheus_query(scraped_traffic, substitute(expr))
        if answer["status"] != "success":
            failures.append(f"{dashboard} / {title}: {expr}\n  error: {answer.get('error')}")
        elif not answer["data"]["result"]:
            failures.append(f"{dashboard} / {title}: {expr}\n  no series")
    assert not failures, f"{len(failures)} of {len(targets)} queries failed:\n" + "\n".join(
        failures
    )


def test_every_template_variable_has_values(scraped_traffic: LocalMesh) -> None:
    failures = []
    for path in DASHBOARDS:
        for variable in json.loads(path.read_text())["templating"]["list"]:
            if variable["type"] != "query":
                continue
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["definition"])
            assert match, f"{path.name} ${variable['name']}: {variable['definition']}"
            selector, label = match.groups()
            found = series(scraped_traffic, f"count by ({label}) ({substitute(selector)})")
            if not [s for s in found if s["metric"].get(label)]:
                failures.append(f"{path.name} ${variable['name']}: {variable['definition']}")
    assert not failures, failures


async def test_workers_count_prefix_cache_lookups_as_vllms_own_counters(
    scraped_traffic: LocalMesh,
) -> None:
    """The ops feed's prefix-cache counts (each worker's GetEngineStats) are the dashboards'
    (vLLM's vllm:prefix_cache_*_total on the worker's metrics port), read once it is idle."""
    for worker in (p for p in scraped_traffic.programs if p.service == "worker"):
        async with aio.insecure_channel(worker.address) as channel:
            stats = await inference_pb2_grpc.InferenceServiceStub(channel).GetEngineStats(
                inference_pb2.EngineStatsRequest(), timeout=30
            )
        metrics = scrape_metrics(worker.metrics_port or 0)
        queries = metric_value(metrics, "vllm:prefix_cache_queries_total")
        hits = metric_value(metrics, "vllm:prefix_cache_hits_total")
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (queries, hits), worker.name
        assert stats.prefix_cache_queries > 0, worker.name
