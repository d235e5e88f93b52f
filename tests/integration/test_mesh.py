"""The whole local mesh as `make up` runs it (supervisord, control plane, real Envoy, 2 gateways,
2 workers, reranker): per-stream balancing, health-driven routing, discovery changes,
cancellation through every hop, and gRPC, gRPC-Web and REST at the edge."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import time
from collections.abc import AsyncIterator, Callable

import grpc
import psutil
import pytest
import yaml
from grpc import aio

from tests.harness import health_probe
from tests.support import (
    INFERENCE_METHOD,
    PREPARE_METHOD,
    cancel_generations,
    grpc_web_generate,
    grpcurl,
    grpcurl_messages,
    metric_value,
    positions,
    scrape_metrics,
)
from tests.timing import within_budget
from tokenmesh.localmesh.mesh import LocalMesh, Program
from tokenmesh.meshconfig.stream_relay import RELAY
from tokenmesh.v1 import llm_pb2, llm_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def local_mesh(mesh: LocalMesh) -> LocalMesh:
    """The session's shared mesh (tests/integration/conftest.py)."""
    return mesh


def started_on(program: Program, method: dict[str, str]) -> float:
    """grpc_server_started_total for method on one replica."""
    text = scrape_metrics(program.metrics_port or 0)
    return metric_value(text, "grpc_server_started_total", 0.0, **method)


def started(local_mesh: LocalMesh, service: str, method: dict[str, str]) -> list[float]:
    return [started_on(program, method) for program in local_mesh.replicas(service)]


@pytest.fixture(scope="module")
async def edge(local_mesh: LocalMesh) -> AsyncIterator[llm_pb2_grpc.LLMServiceStub]:
    async with aio.insecure_channel(f"127.0.0.1:{local_mesh.settings.edge_port}") as channel:
        yield llm_pb2_grpc.LLMServiceStub(channel)


async def generate(edge: llm_pb2_grpc.LLMServiceStub, i: int, tokens: int = 16) -> list[int]:
    request = llm_pb2.GenerateRequest(prompt=f"mesh {i}", max_tokens=tokens, ignore_eos=True)
    return positions([token async for token in edge.Generate(request, timeout=120)])


def wait_until(condition: Callable[[], bool], within: float, every: float = 0.1) -> float:
    """Seconds until condition() held; fails after `within`."""
    started_at = time.monotonic()
    while not condition():
        assert time.monotonic() - started_at < within, f"not true within {within}s"
        time.sleep(every)
    return time.monotonic() - started_at


def healthy_hosts(local_mesh: LocalMesh, cluster: str) -> set[str]:
    return {address for address, ok in local_mesh.envoy_hosts().get(cluster, []) if ok}


async def test_40_streams_from_one_channel_spread_over_gateways_and_workers(
    local_mesh: LocalMesh, edge
) -> None:
    # On the direct token path (the mesh's) a gateway prepares each stream.
    gateway_method = PREPARE_METHOD
    # Envoy may take a moment to put a just-ready replica in rotation: wait (bounded) until a
    # request has landed on every worker and every gateway before measuring the spread.
    for attempt in range(60):
        if min(started(local_mesh, "worker", INFERENCE_METHOD)) and min(
            started(local_mesh, "gateway", gateway_method)
        ):
            break
        await generate(edge, attempt, tokens=1)
        await asyncio.sleep(0.1)
    gateways_before = started(local_mesh, "gateway", gateway_method)
    workers_before = started(local_mesh, "worker", INFERENCE_METHOD)
    # Long enough that all 40 are in flight together: least-request balancing then has to
    # spread them, rather than favouring whichever replica happens to finish short ones first.
    results = await asyncio.gather(*(generate(edge, i, tokens=256) for i in range(40)))
    assert all(indexes == list(range(256)) for indexes in results)
    per_gateway = [
        a - b
        for a, b in zip(
            started(local_mesh, "gateway", gateway_method), gateways_before, strict=True
        )
    ]
    per_worker = [
        a - b
        for a, b in zip(
            started(local_mesh, "worker", INFERENCE_METHOD), workers_before, strict=True
        )
    ]
    print(f"streams per gateway {per_gateway}, per worker {per_worker}")
    assert sum(per_gateway) == 40 and sum(per_worker) == 40
    # One client connection, yet every replica took a real share: balancing is per stream.
    assert min(per_gateway) >= 10 and min(per_worker) >= 10


def test_grpcurl_through_the_edge_lists_describes_and_streams(local_mesh: LocalMesh) -> None:
    edge = f"127.0.0.1:{local_mesh.settings.edge_port}"
    listed = grpcurl(edge, "list")
    assert "tokenmesh.v1.LLMService" in listed.stdout.split(), listed.stderr
    described = grpcurl(edge, "describe", "tokenmesh.v1.LLMService")
    assert (
        "rpc Generate ( .tokenmesh.v1.GenerateRequest ) returns ( stream .tokenmesh.v1.Token )"
        in (described.stdout)
    )
    body = '{"prompt":"hello","max_tokens":16,"ignore_eos":true}'
    streamed = grpcurl("-d", body, edge, "tokenmesh.v1.LLMService/Generate")
    assert streamed.returncode == 0, streamed.stderr
    # Every one of the 16 tokens, however the worker grouped them into messages.
    assert positions(grpcurl_messages(streamed.stdout)) == list(range(16)), streamed.stdout


async def test_envoy_access_log_times_where_a_streams_first_token_waited(
    local_mesh: LocalMesh, edge
) -> None:
    """Each hop's access-log line splits a stream's first-token wait: until Envoy sent the
    request upstream, until the upstream's first byte, until it went downstream; all within
    the stream's duration, which for 1,024 tokens lasts well past the first (a warm engine
    makes 256 of the tiny model's tokens in under 50 ms). On the direct token path the edge's
    line is the only hop (its upstream is the worker); through a gateway the worker's hop has
    its own."""
    log = local_mesh.log_dir / "envoy.log"
    seen = log.stat().st_size
    assert len(await generate(edge, 0, tokens=1024)) == 1024
    # Over 16 bytes a token (a message of one token is about 30): more than any stream this
    # module sends before this one.
    min_bytes = 16 * 1024

    def lines() -> list[dict[str, str]]:
        with log.open("rb") as text:
            text.seek(seen)
            rows = [json.loads(line) for line in text.read().splitlines() if line.startswith(b"{")]
        return [row for row in rows if row.get("path", "").endswith("/Generate")]

    # This stream's lines: Envoy flushes its log every second, so lines of earlier, shorter
    # streams may come after `seen`; none of them carries this one's bytes.
    def ours() -> dict[str, dict[str, str]]:
        return {row["listener"]: row for row in lines() if int(row["bytes_sent"]) >= min_bytes}

    if local_mesh.settings.mesh().relays:
        # Through the edge's stream relay: the edge's line sends the stream to the relay's
        # listener, whose line names the worker it ended on (the relay is no router: Envoy's
        # upstream timings are the edge's).
        wait_until(lambda: {"edge", RELAY} <= set(ours()), within=10)
        by_hop = ours()
        relayed = by_hop.pop(RELAY)
        assert by_hop["edge"]["upstream_cluster"] == RELAY, by_hop
        workers = {p.address for p in local_mesh.programs if p.service == "worker"}
        assert relayed["upstream_host"] in workers, (relayed, workers)
        assert (relayed["upstream_cluster"], relayed["moves"]) == ("worker", 0), relayed
        assert by_hop["edge"]["worker"] == relayed["upstream_host"], by_hop
    else:
        # The direct token path: the edge takes the stream straight from a worker.
        wait_until(lambda: "edge" in ours(), within=10)
        by_hop = ours()
        assert by_hop["edge"]["upstream_cluster"] == "worker", by_hop
        assert by_hop["edge"]["worker"] == by_hop["edge"]["upstream_host"], by_hop
    for hop, row in by_hop.items():
        sent, first, out, duration = (
            float(row[key])
            for key in ("upstream_sent_ms", "first_byte_ms", "first_sent_ms", "duration_ms")
        )
        assert 0 <= sent <= first <= out <= duration, (hop, row)
        assert duration - first >= 50, (hop, row)


def test_rest_json_generate_streams_one_json_object_per_token(local_mesh: LocalMesh) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", local_mesh.settings.edge_port, timeout=60)
    body = json.dumps({"prompt": "hello", "max_tokens": 8, "ignore_eos": True})
    connection.request(
        "POST", "/tokenmesh.v1.LLMService/Generate", body, {"content-type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200
    lines = [line for line in response.read().decode().splitlines() if line.strip()]
    tokens = [json.loads(line.strip().lstrip("[").rstrip(",]")) for line in lines]
    assert positions(tokens) == list(range(8))
    assert tokens[-1]["finish_reason"] == "FINISH_REASON_LENGTH"


def test_grpc_web_generate_streams_tokens(local_mesh: LocalMesh) -> None:
    origin = "http://localhost:3000"
    response, tokens, trailers = grpc_web_generate(local_mesh.settings.edge_port, 8, origin)
    assert response.status == 200
    assert response.getheader("access-control-allow-origin") == origin
    assert positions(tokens) == list(range(8))
    assert "grpc-status:0" in trailers.replace(" ", "")


async def test_client_cancel_through_the_edge_frees_every_engine(
    local_mesh: LocalMesh, edge
) -> None:
    workers = [worker.address for worker in local_mesh.replicas("worker")]
    await within_budget(
        "every engine empty after the cancel", lambda: cancel_generations(edge, workers)
    )


async def test_stopped_worker_gets_no_new_streams_and_rejoins(local_mesh: LocalMesh, edge) -> None:
    first, second = local_mesh.replicas("worker")
    pid = local_mesh.pid(second.name)
    psutil.Process(pid).suspend()  # SIGSTOP: health checks time out, like a wedged host
    try:
        took = wait_until(lambda: second.address not in healthy_hosts(local_mesh, "worker"), 10)
        print(f"stopped worker left the healthy set in {took:.1f}s")
        assert took <= 3.5
        before = started_on(first, INFERENCE_METHOD)  # the paused one cannot answer a scrape
        await asyncio.gather(*(generate(edge, i, tokens=4) for i in range(10)))
        assert started_on(first, INFERENCE_METHOD) - before == 10
    finally:
        psutil.Process(pid).resume()
    took = wait_until(lambda: second.address in healthy_hosts(local_mesh, "worker"), 10)
    print(f"resumed worker rejoined in {took:.1f}s")
    assert first.address in healthy_hosts(local_mesh, "worker")


async def test_discovery_change_reaches_envoy(local_mesh: LocalMesh, edge) -> None:
    endpoints = yaml.safe_load(local_mesh.endpoints_path.read_text())
    removed = endpoints["clusters"]["worker"].pop()
    local_mesh.endpoints_path.write_text(yaml.safe_dump(endpoints))
    try:
        took = wait_until(
            lambda: removed not in {a for a, _ in local_mesh.envoy_hosts().get("worker", [])}, 10
        )
        print(f"worker removed from discovery left Envoy in {took:.2f}s")
        assert took <= 2.5
    finally:
        local_mesh.write_configs()  # the full endpoint list again
    took = wait_until(lambda: removed in healthy_hosts(local_mesh, "worker"), 10)
    print(f"worker added back to discovery was healthy in Envoy in {took:.2f}s")
    assert took <= 3.5
    # Once Envoy reports it healthy, its load balancers use it at once (no merge window): the
    # first streams after that already reach it.
    back = next(worker for worker in local_mesh.replicas("worker") if worker.address == removed)
    before = started_on(back, INFERENCE_METHOD)
    results = await asyncio.gather(*(generate(edge, i, tokens=32) for i in range(8)))
    assert all(indexes == list(range(32)) for indexes in results)
    assert started_on(back, INFERENCE_METHOD) - before > 0


def test_sigterm_drains_a_worker_while_its_stream_finishes(local_mesh: LocalMesh) -> None:
    """Rolling update of one worker: NOT_SERVING, no new streams, the in-flight one completes."""
    worker = local_mesh.replicas("worker")[0]
    with grpc.insecure_channel(f"127.0.0.1:{local_mesh.settings.edge_port}") as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        # Aim a long stream at this worker: ask until one lands there (bounded).
        for attempt in range(20):
            before = started_on(worker, INFERENCE_METHOD)
            stream = stub.Generate(
                llm_pb2.GenerateRequest(prompt=f"drain {attempt}", max_tokens=600, ignore_eos=True)
            )
            first = next(stream)
            if started_on(worker, INFERENCE_METHOD) > before:
                break
            stream.cancel()
        else:
            pytest.fail("no stream landed on the first worker in 20 tries")
        pid = local_mesh.pid(worker.name)
        psutil.Process(pid).send_signal(signal.SIGTERM)
        took = wait_until(lambda: worker.address not in healthy_hosts(local_mesh, "worker"), 10)
        print(f"draining (NOT_SERVING) worker left the healthy set in {took:.1f}s")
        assert took <= 2.0
        rest = list(stream)
        assert positions([first, *rest]) == list(range(600))
    # supervisord restarts it; it rejoins once its model has loaded again.
    wait_until(lambda: worker.address in healthy_hosts(local_mesh, "worker"), 300, every=1)


async def test_workers_saturated_by_logprob_streams_stay_in_envoys_rotation(
    local_mesh: LocalMesh,
) -> None:
    """The short version of loadtests/worker_health_probe.py: 32 streams of 1,800 tokens with 20
    logprobs each keep both workers' Python processes busy (vLLM's logprob processing), the
    workers still answer health checks well within Envoy's timeout, and Envoy's active health
    checks of both all pass, so neither worker ever leaves the rotation — unless the machine
    itself stalled past that timeout (the idle reranker, checked by the same process, shows it),
    which no worker could answer through."""
    row = await health_probe.probe(local_mesh, streams=32, tokens=1800)
    print(json.dumps(row))
    assert row["outcomes"] == {"OK": 32} and row["tokens_received"] == 32 * 1800, row
    envoy = row["envoy_worker_cluster"]
    assert envoy["health_check.attempt"] > 0, row
    timeout = local_mesh.settings.mesh().health_check_timeout_seconds
    for checks in row["direct_checks"].values():
        assert checks.get("p50_s", timeout) < timeout / 4, row
    floor = max(checks.get("max_s", 0.0) for checks in row["idle_reranker_checks"].values())
    if floor >= timeout:
        print(
            f"the idle reranker's check took {floor} s, past Envoy's {timeout} s timeout: the "
            "machine stalled, so Envoy's failed checks are not the workers'"
        )
        return
    assert envoy["health_check.failure"] == 0, row
    assert row["samples_with_a_worker_out_of_rotation"] == 0, row
