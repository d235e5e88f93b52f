"""The direct token path: a second Envoy, rendered with direct_token_path, in front of the
session mesh's gateways and workers (endpoints from its control plane). Generate is prepared by
a gateway (Envoy's external processor) and streamed by Envoy straight from a worker: gRPC and
REST callers see the same stream and the same errors, cancels still free the engine, only
what a gateway prepared reaches a worker, and the gateways still count every stream (Envoy's
access log)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator

import grpc
import psutil
import pytest
from grpc import aio

from tests.harness.meshes import second_envoy
from tests.support import (
    GENERATE_METHOD,
    INFERENCE_METHOD,
    PREPARE_METHOD,
    ROOT,
    engine_empty_at,
    grpc_web_generate,
    metric_value,
    positions,
    scrape_metrics,
)
from tokenmesh.localmesh.mesh import LocalMesh, Program, envoy_hosts
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, llm_pb2, llm_pb2_grpc, token_pb2

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def direct(mesh: LocalMesh) -> Iterator[MeshSettings]:
    """A second Envoy with the direct token path, sharing the mesh's services (its config and
    access log among the mesh's logs)."""
    with second_envoy(mesh, mesh.log_dir, direct_token_path=True) as (settings, _):
        yield settings


@pytest.fixture
async def edge(direct: MeshSettings) -> AsyncIterator[llm_pb2_grpc.LLMServiceStub]:
    async with aio.insecure_channel(f"127.0.0.1:{direct.edge_port}") as channel:
        yield llm_pb2_grpc.LLMServiceStub(channel)


def total(mesh: LocalMesh, service: str, name: str, **labels: str) -> float:
    return sum(
        metric_value(scrape_metrics(program.metrics_port or 0), name, 0.0, **labels)
        for program in mesh.replicas(service)
    )


def started(mesh: LocalMesh, service: str, method: dict[str, str]) -> float:
    return total(mesh, service, "grpc_server_started_total", **method)


async def test_generate_streams_from_a_worker_with_no_gateway_on_the_way(
    mesh: LocalMesh, edge: llm_pb2_grpc.LLMServiceStub
) -> None:
    before = {
        "itl": total(mesh, "gateway", "tokenmesh_inter_token_latency_seconds_count"),
        "process": started(mesh, "gateway", PREPARE_METHOD),
        "worker": started(mesh, "worker", INFERENCE_METHOD),
        "direct": total(
            mesh, "gateway", "tokenmesh_gateway_direct_requests_total", api="grpc", outcome="direct"
        ),
    }
    request = llm_pb2.GenerateRequest(prompt="direct path", max_tokens=64, ignore_eos=True)
    tokens = [token async for token in edge.Generate(request, timeout=120)]
    assert positions(tokens) == list(range(64))
    assert tokens[-1].finish_reason == token_pb2.FINISH_REASON_LENGTH
    assert tokens[-1].usage.completion_tokens == 64
    # One external-processor call and one worker stream; no gateway sent its messages (the
    # gateways count the stream itself from Envoy's access log: a test below).
    assert started(mesh, "gateway", PREPARE_METHOD) - before["process"] == 1
    itl = total(mesh, "gateway", "tokenmesh_inter_token_latency_seconds_count")
    assert itl == before["itl"]
    assert started(mesh, "worker", INFERENCE_METHOD) - before["worker"] == 1
    direct_now = total(
        mesh, "gateway", "tokenmesh_gateway_direct_requests_total", api="grpc", outcome="direct"
    )
    assert direct_now - before["direct"] == 1


async def test_bad_input_gets_the_gateways_status_and_message(
    mesh: LocalMesh, edge: llm_pb2_grpc.LLMServiceStub
) -> None:
    """A request the gateway refuses goes on to its own handler, which refuses it as ever."""
    refused_by_handler = {**GENERATE_METHOD, "grpc_code": "INVALID_ARGUMENT"}
    before = total(mesh, "gateway", "grpc_server_handled_total", **refused_by_handler)
    request = llm_pb2.GenerateRequest(prompt="x", max_tokens=10**6)
    with pytest.raises(aio.AioRpcError) as refused:
        [token async for token in edge.Generate(request, timeout=30)]
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("max_tokens: must be in [1, "), (
        refused.value.details()
    )
    with pytest.raises(aio.AioRpcError) as empty:
        [token async for token in edge.Generate(llm_pb2.GenerateRequest(), timeout=30)]
    assert empty.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert empty.value.details() == "prompt: must not be empty"
    # The handler's count is recorded as its RPC ends, which the caller may see first.
    deadline = time.monotonic() + 10
    while total(mesh, "gateway", "grpc_server_handled_total", **refused_by_handler) - before < 2:
        assert time.monotonic() < deadline, "the gateway's handler did not refuse both"
        await asyncio.sleep(0.1)
    after = total(mesh, "gateway", "grpc_server_handled_total", **refused_by_handler)
    assert after - before == 2


def test_rest_json_generate_streams_and_refuses_like_grpc(direct: MeshSettings) -> None:
    def post(body: dict[str, object]) -> tuple[int, str]:
        connection = http.client.HTTPConnection("127.0.0.1", direct.edge_port, timeout=60)
        connection.request(
            "POST",
            "/tokenmesh.v1.LLMService/Generate",
            json.dumps(body),
            {"content-type": "application/json"},
        )
        response = connection.getresponse()
        return response.status, response.read().decode()

    status, text = post({"prompt": "hello", "max_tokens": 8, "ignore_eos": True})
    assert status == 200, text
    lines = [line.strip().lstrip("[").rstrip(",]") for line in text.splitlines() if line.strip()]
    tokens = [json.loads(line) for line in lines]
    assert positions(tokens) == list(range(8))
    assert tokens[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    status, text = post({"prompt": "hello", "max_tokens": 10**6})
    assert status == 400, text
    assert "max_tokens: must be in [1, " in text


async def test_the_workers_method_is_not_served_at_the_edge(
    mesh: LocalMesh, direct: MeshSettings
) -> None:
    before = started(mesh, "worker", INFERENCE_METHOD)
    async with aio.insecure_channel(f"127.0.0.1:{direct.edge_port}") as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = inference_pb2.InferenceRequest(
            prompt="bypass", sampling=inference_pb2.SamplingParams(max_tokens=4)
        )
        with pytest.raises(aio.AioRpcError) as refused:
            [token async for token in stub.Generate(request, timeout=30)]
    assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert started(mesh, "worker", INFERENCE_METHOD) == before


# A client in a process of its own (so the test can stop it): STREAMS streams of one-token
# messages on one connection, each read to its end; prints each stream's token positions.
READER = """
import asyncio, json, sys
from grpc import aio
from tests.support import positions
from tokenmesh.v1 import llm_pb2, llm_pb2_grpc

async def main(edge, streams, tokens):
    async with aio.insecure_channel(edge) as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        calls = [
            stub.Generate(llm_pb2.GenerateRequest(
                prompt=f"late reader {i}", max_tokens=tokens, ignore_eos=True), timeout=300)
            for i in range(streams)
        ]
        firsts = [await call.read() for call in calls]
        print("reading", flush=True)
        streams = []
        for first, call in zip(firsts, calls):
            tokens = [first]
            while (token := await call.read()) is not aio.EOF:
                tokens.append(token)
            streams.append(positions(tokens))
        print(json.dumps(streams))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


def flood_closes(admin_port: int) -> int:
    """Connections Envoy has cut for queueing too many frames (HTTP/2 flood protection)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/stats", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return sum(int(line.rsplit(":", 1)[1]) for line in lines if "outbound_flood" in line)


async def test_a_client_that_reads_late_is_held_back_not_cut_off(
    mesh: LocalMesh, direct: MeshSettings
) -> None:
    """A client that stops reading its streams of small token messages: Envoy queues their
    frames until flow control stops the workers, never counts them as a flood (which cuts the
    connection and every stream on it), and every token arrives once the client reads again."""
    streams, tokens = 8, 1500
    reader = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        READER,
        f"127.0.0.1:{direct.edge_port}",
        str(streams),
        str(tokens),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert reader.stdout is not None
        line = await asyncio.wait_for(reader.stdout.readline(), 120)
        assert line.strip() == b"reading"
        psutil.Process(reader.pid).suspend()  # SIGSTOP: it reads nothing more
        try:
            async with contextlib.AsyncExitStack() as channels:
                for worker in mesh.replicas("worker"):
                    channel = await channels.enter_async_context(
                        aio.insecure_channel(worker.address)
                    )
                    # Every token made: what the client has not read waits in the mesh. Any
                    # empty report will do: an engine that got none of the streams (or made its
                    # share before the client stopped) never reports again.
                    await engine_empty_at(
                        inference_pb2_grpc.InferenceServiceStub(channel), 0, within=240
                    )
        finally:
            psutil.Process(reader.pid).resume()
        output, _ = await asyncio.wait_for(reader.communicate(), 120)
    finally:
        if reader.returncode is None:
            reader.kill()
            await reader.wait()
    assert reader.returncode == 0, "the reader's streams failed (see its error above)"
    assert json.loads(output) == [list(range(tokens))] * streams
    assert flood_closes(direct.admin_port) == 0


def test_grpc_web_generate_takes_the_gateways_path(mesh: LocalMesh, direct: MeshSettings) -> None:
    """Envoy's gRPC-Web filter moves a stream's trailers into its body, out of the access log's
    sight: the gateway's own handler serves gRPC-Web, so its status and tokens are counted."""
    outcomes = "tokenmesh_gateway_direct_requests_total"
    before = [
        total(mesh, "gateway", outcomes, api="grpc", outcome=o) for o in ("gateway", "direct")
    ]
    origin = "http://localhost:3000"
    response, tokens, trailers = grpc_web_generate(direct.edge_port, 8, origin)
    assert response.status == 200
    assert response.getheader("access-control-allow-origin") == origin
    assert positions(tokens) == list(range(8))
    assert "grpc-status:0" in trailers.replace(" ", "")
    after = [total(mesh, "gateway", outcomes, api="grpc", outcome=o) for o in ("gateway", "direct")]
    assert [now - then for now, then in zip(after, before, strict=True)] == [1, 0]


async def test_the_callers_deadline_holds_and_reaches_the_worker(
    mesh: LocalMesh, edge: llm_pb2_grpc.LLMServiceStub
) -> None:
    aborted = "tokenmesh_worker_aborted_requests_total"
    before = total(mesh, "worker", aborted, reason="deadline_exceeded") + total(
        mesh, "worker", aborted, reason="cancelled"
    )
    request = llm_pb2.GenerateRequest(prompt="deadline", max_tokens=2000, ignore_eos=True)
    call = edge.Generate(request, timeout=1.0)
    begun = time.monotonic()
    with pytest.raises(aio.AioRpcError) as expired:
        [token async for token in call]
    assert expired.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - begun < 5
    deadline = time.monotonic() + 10
    while (
        total(mesh, "worker", aborted, reason="deadline_exceeded")
        + total(mesh, "worker", aborted, reason="cancelled")
        == before
    ):
        assert time.monotonic() < deadline, "the worker never aborted the expired request"
        await asyncio.sleep(0.1)


CALLS = "tokenmesh_gateway_calls_total"
GATEWAY_COUNTS = (
    (CALLS, {**GENERATE_METHOD, "path": "direct", "grpc_code": "OK"}),
    (CALLS, {**GENERATE_METHOD, "path": "gateway", "grpc_code": "OK"}),
    (CALLS, {**GENERATE_METHOD, "path": "direct", "grpc_code": "CANCELLED"}),
    (CALLS, {**GENERATE_METHOD, "path": "direct", "grpc_code": "DEADLINE_EXCEEDED"}),
    # What the gateways' own servers handled: the gRPC-Web stream only.
    ("grpc_server_handled_total", {**GENERATE_METHOD, "grpc_code": "OK"}),
    ("grpc_server_stream_msg_sent_total", GENERATE_METHOD),
    ("tokenmesh_ttft_seconds_count", {}),
    ("tokenmesh_tokens_generated_total", {}),
    ("tokenmesh_request_duration_seconds_count", {"grpc_code": "OK"}),
)


def gateway_counts(mesh: LocalMesh) -> list[float]:
    return [total(mesh, "gateway", name, **labels) for name, labels in GATEWAY_COUNTS]


async def test_the_gateways_count_the_streams_they_never_see(
    mesh: LocalMesh, direct: MeshSettings, edge: llm_pb2_grpc.LLMServiceStub
) -> None:
    """The dashboards and the alerts read the gateways' metrics: direct streams count there
    (from Envoy's access log, a moment after each ends) as calls on the direct path with the
    status the caller saw, their first token and their tokens; a gRPC-Web stream, which takes
    the gateway's path, once, on that path (and in grpc_server_*, which only it reaches)."""
    # Earlier tests' streams are logged within Envoy's flush interval (0.5 s) of their end.
    await asyncio.sleep(1.5)
    before = gateway_counts(mesh)
    request = llm_pb2.GenerateRequest(prompt="counted", max_tokens=16, ignore_eos=True)
    call = edge.Generate(request, timeout=60)
    tokens = [token async for token in call]
    assert tokens[-1].usage.completion_tokens == 16
    _, web_tokens, _ = grpc_web_generate(direct.edge_port, 8, "http://localhost:3000")
    assert positions(web_tokens) == list(range(8))
    cancelled = edge.Generate(
        llm_pb2.GenerateRequest(prompt="cancelled", max_tokens=2000, ignore_eos=True), timeout=60
    )
    assert (await cancelled.read()).index == 0
    cancelled.cancel()
    # The expired stream counts a first token only if it had one before its deadline: it
    # reads that token first, so a loaded machine cannot turn the count into a race (2 s is
    # far below the 2,000 tokens' time, far above one token's).
    request = llm_pb2.GenerateRequest(prompt="expired", max_tokens=2000, ignore_eos=True)
    expiring = edge.Generate(request, timeout=2.0)
    assert (await expiring.read()).index == 0
    with pytest.raises(aio.AioRpcError) as expired:
        while await expiring.read() is not aio.EOF:
            pass
    assert expired.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    expected = [1, 1, 1, 1, 1, len(web_tokens), 4, 16 + 8, 2]

    def added() -> list[float]:
        return [now - then for now, then in zip(gateway_counts(mesh), before, strict=True)]

    deadline = time.monotonic() + 15
    while added() != expected:
        assert time.monotonic() < deadline, (added(), expected)
        await asyncio.sleep(0.25)


async def test_envoys_own_interfaces_are_not_served_at_the_edge(direct: MeshSettings) -> None:
    """A caller cannot write the gateways' metrics through the access log, nor ask for a
    preparation: those are for the mesh's Envoys."""
    async with aio.insecure_channel(f"127.0.0.1:{direct.edge_port}") as channel:
        log = channel.stream_unary("/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs")
        with pytest.raises(aio.AioRpcError) as refused:
            await log(iter([b""]), timeout=30)
    assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED


async def test_a_request_no_gateway_prepared_in_time_says_so(mesh: LocalMesh) -> None:
    """Envoy fails a request its external processor did not answer within the edge's limit
    (UNAVAILABLE: retry) with no message of its own: the edge's says why and names the limit.
    (Its health checks, slowed here, would soon take hung gateways out of its rotation.)"""
    gateways = [psutil.Process(mesh.pid(gateway.name)) for gateway in mesh.replicas("gateway")]
    with second_envoy(
        mesh,
        mesh.log_dir,
        direct_token_path=True,
        prepare_timeout_seconds=1,
        health_check_interval_seconds=60,
    ) as (settings, _):
        async with aio.insecure_channel(f"127.0.0.1:{settings.edge_port}") as channel:
            request = llm_pb2.GenerateRequest(prompt="in time?", max_tokens=4)
            for gateway in gateways:
                gateway.suspend()  # SIGSTOP: hung, it answers nothing
            try:
                with pytest.raises(aio.AioRpcError) as failed:
                    stream = llm_pb2_grpc.LLMServiceStub(channel).Generate(request, timeout=60)
                    [token async for token in stream]
            finally:
                for gateway in gateways:
                    gateway.resume()
    await back_in_rotation(mesh, mesh.replicas("gateway"))
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
    assert failed.value.details() == (
        "no gateway prepared the request within the edge's prepare_timeout_seconds (1 s); retry"
    )


async def back_in_rotation(
    mesh: LocalMesh, programs: list[Program], *others: MeshSettings, within: float = 180
) -> None:
    """Until the mesh's Envoy (and the `others`) route to every one of `programs` again."""
    deadline = time.monotonic() + within
    for program in programs:
        while not all(
            (program.address, True) in hosts.get(program.service or "", [])
            for hosts in [mesh.envoy_hosts(), *(envoy_hosts(o.admin_port) for o in others)]
        ):
            assert time.monotonic() < deadline, f"{program.name} not back within {within} s"
            await asyncio.sleep(0.5)


async def test_a_killed_gateway_costs_no_caller_a_request(
    mesh: LocalMesh, direct: MeshSettings, edge: llm_pb2_grpc.LLMServiceStub
) -> None:
    """Until Envoy's health checks see a gateway is gone, it still sends it preparations; each
    fails before the gateway answered (refused or reset), and another gateway prepares it."""

    async def generate(i: int) -> list[int]:
        request = llm_pb2.GenerateRequest(prompt=f"gone {i}", max_tokens=4, ignore_eos=True)
        return positions([token async for token in edge.Generate(request, timeout=60)])

    gateway = mesh.replicas("gateway")[-1]
    psutil.Process(mesh.pid(gateway.name)).kill()
    try:
        results = await asyncio.gather(*map(generate, range(16)), return_exceptions=True)
    finally:
        # supervisord starts it again; later tests need it back in both Envoys' rotation.
        await back_in_rotation(mesh, [gateway], direct)
    assert results == [list(range(4))] * 16
