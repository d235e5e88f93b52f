"""Health, reflection (through the real grpcurl), metrics, graceful SIGTERM and engine death."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import grpc
import pytest
from grpc import aio

from tests.conftest import WORKER_ENGINE_ARGS
from tests.support import (
    ROOT,
    ServiceProcess,
    engine_cores,
    grpcurl,
    health_status,
    metric_value,
    positions,
    read_rest,
    scrape_metrics,
    worker_process,
)
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.integration


def test_health_is_not_serving_while_the_model_loads(worker: ServiceProcess) -> None:
    # The session fixture polled health from process start: the port answered NOT_SERVING
    # during the model load, then SERVING.
    assert worker.health_answers[:2] == ["NOT_SERVING", "SERVING"], worker.health_history
    assert health_status(worker.address) == "SERVING"


def test_grpcurl_lists_and_describes_through_reflection(worker: ServiceProcess) -> None:
    listed = grpcurl(worker.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert "tokenmesh.v1.InferenceService" in listed.stdout.split()
    assert "grpc.health.v1.Health" in listed.stdout.split()
    described = grpcurl(worker.address, "describe", "tokenmesh.v1.InferenceService")
    assert (
        "rpc Generate ( .tokenmesh.v1.InferenceRequest ) returns ( stream .tokenmesh.v1.Token )"
        in described.stdout
    )


def test_grpcurl_streams_16_tokens(worker: ServiceProcess) -> None:
    """The README's call: grpcurl prints one JSON object per streamed token."""
    body = '{"prompt":"hello","sampling":{"max_tokens":16,"ignore_eos":true}}'
    result = grpcurl(
        "-emit-defaults", "-d", body, worker.address, "tokenmesh.v1.InferenceService/Generate"
    )
    assert result.returncode == 0, result.stderr
    decoder = json.JSONDecoder()
    text, tokens = result.stdout.strip(), []
    while text:
        token, end = decoder.raw_decode(text)
        tokens.append(token)
        text = text[end:].strip()
    assert positions(tokens) == list(range(16))
    assert tokens[-1]["finish_reason"] == "FINISH_REASON_LENGTH"


async def test_metrics_count_rpcs_messages_and_tokens(inference, worker: ServiceProcess) -> None:
    before = scrape_metrics(worker.metrics_port)
    method = dict(grpc_service="tokenmesh.v1.InferenceService", grpc_method="Generate")

    def value(text: str, name: str, **labels: str) -> float:
        return metric_value(text, name, 0.0, **method, **labels)

    request = inference_pb2.InferenceRequest(
        prompt="count me", sampling=inference_pb2.SamplingParams(max_tokens=10, ignore_eos=True)
    )
    messages = [t async for t in inference.Generate(request)]
    assert positions(messages) == list(range(10))
    with pytest.raises(aio.AioRpcError):
        bad = inference_pb2.InferenceRequest(prompt="", sampling=request.sampling)
        async for _ in inference.Generate(bad):
            pass

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # The status reaches the client before the server's interceptor counts the call (it is
    # sent from inside the handler), so wait until both calls are counted.
    counted_by = time.monotonic() + 10
    while True:
        after = scrape_metrics(worker.metrics_port)
        if delta("grpc_server_handling_seconds_count") >= 2 or time.monotonic() > counted_by:
            break
        await asyncio.sleep(0.05)

    assert delta("grpc_server_started_total", grpc_type="server_stream") == 2
    assert delta("grpc_server_handled_total", grpc_code="OK") == 1
    assert delta("grpc_server_handled_total", grpc_code="INVALID_ARGUMENT") == 1
    # One sent message per message received (outputs merge when the caller is behind).
    assert delta("grpc_server_stream_msg_sent_total") == len(messages)
    assert delta("grpc_server_stream_msg_received_total") == 2
    assert delta("grpc_server_handling_seconds_count") == 2
    assert (
        metric_value(after, "tokenmesh_tokens_generated_total")
        - metric_value(before, "tokenmesh_tokens_generated_total")
        == 10
    )
    assert metric_value(after, "tokenmesh_ttft_seconds_count") > 0
    assert metric_value(after, "tokenmesh_inter_token_latency_seconds_count") > 0
    assert metric_value(after, "tokenmesh_worker_running_requests") == 0
    assert metric_value(after, "tokenmesh_worker_waiting_requests") == 0
    assert 0 <= metric_value(after, "tokenmesh_worker_kv_cache_usage_ratio") <= 1
    # vLLM's own metrics are re-exported.
    assert "vllm:num_requests_running" in after


@pytest.mark.stops_worker
async def test_sigterm_lets_the_in_flight_stream_finish_then_exits_0(
    worker: ServiceProcess,
) -> None:
    # Well inside the test worker's 5 s grace: one stream of 600 tokens outlasted it on a CPU
    # without AVX-512, and was cancelled as it should be.
    tokens = 200
    async with aio.insecure_channel(worker.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = inference_pb2.InferenceRequest(
            prompt="finish me",
            sampling=inference_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True),
        )
        call = stub.Generate(request)
        first = await call.read()
        worker.signal(signal.SIGTERM)
        rest = await read_rest(call)
        assert positions([first, *rest]) == list(range(tokens))
        # NOT_SERVING at once; new work is still served while it drains (DRAIN_SECONDS, so
        # that Envoy sees NOT_SERVING before the worker stops accepting), then refused.
        assert await asyncio.to_thread(health_status, worker.address) == "NOT_SERVING"
        short = inference_pb2.InferenceRequest(
            prompt="late", sampling=inference_pb2.SamplingParams(max_tokens=1)
        )
        refused = None
        for _ in range(100):
            try:
                async for _ in stub.Generate(short, timeout=30):
                    pass
            except aio.AioRpcError as error:
                refused = error
                break
            await asyncio.sleep(0.1)
        assert refused is not None, "still served 10 s after SIGTERM"
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert worker.process is not None
    assert await asyncio.to_thread(worker.process.wait, 60) == 0


# Not stops_worker: the session's worker is its handover target, so it runs before those.
async def test_engine_death_hands_the_streams_over_then_the_worker_exits_1(
    worker: ServiceProcess,
) -> None:
    """Kill vLLM's engine process mid-stream (the usual GPU fault: the front end lives): the
    worker turns NOT_SERVING at once and hands each stream over to another worker (here the
    session's, reached directly), which goes on from the token where it stopped: every token
    once, numbered on, one end with the whole answer's usage. A stream the next worker cannot
    continue (stop strings) ends UNAVAILABLE naming why. Once they have all ended the worker
    exits 1 for its supervisor to restart."""
    dying = worker_process(
        ROOT / ".run" / "test-logs",
        name="worker-engine-death",
        handover_address=worker.address,
        max_resumptions="2",
    )
    dying.start()
    try:
        dying.wait_serving(300)
        assert dying.process is not None
        # Found before any stream starts, so the kill follows the first tokens at once.
        cores = engine_cores(dying.process.pid)
        assert cores, "no EngineCore child process found"
        max_tokens = 2000
        async with aio.insecure_channel(dying.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            # Enough work that no stream can finish before the kill, however slowly this test
            # process is scheduled: one lone 2,000-token stream once did, on a loaded machine.
            calls = [
                stub.Generate(
                    inference_pb2.InferenceRequest(
                        prompt=f"handed over {i}",
                        sampling=inference_pb2.SamplingParams(
                            max_tokens=max_tokens,
                            ignore_eos=True,
                            stop=["\u2603 never written"] if i >= 6 else [],
                        ),
                    ),
                    metadata=(("x-tenant-id", "t-handover"),),
                    timeout=120,
                )
                for i in range(8)
            ]
            firsts = [await call.read() for call in calls]
            for child in cores:
                os.kill(child.pid, signal.SIGKILL)
            # NOT_SERVING at once, while it still relays the streams it handed over.
            status = await asyncio.to_thread(health_status, dying.address)
            for _ in range(50):
                if status == "NOT_SERVING":
                    break
                await asyncio.sleep(0.1)
                status = await asyncio.to_thread(health_status, dying.address)
            assert status == "NOT_SERVING"
            for i, (call, first) in enumerate(zip(calls, firsts, strict=True)):
                if i >= 6:
                    with pytest.raises(aio.AioRpcError) as error:
                        await read_rest(call)
                    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert "cannot continue on another worker" in error.value.details()
                    assert "resume" in error.value.details()
                    continue
                rest = await read_rest(call)
                tokens = [first, *rest]
                assert positions(tokens) == list(range(max_tokens)), f"stream {i}"
                moved = [t for t in tokens if t.resumed]
                assert [t.resumed for t in moved] == [1], f"stream {i}"
                ends = [t for t in tokens if t.finish_reason]
                assert len(ends) == 1 and ends[0] is tokens[-1]
                assert tokens[-1].usage.completion_tokens == max_tokens
                assert tokens[-1].usage.prompt_tokens > 0
                trailers = dict(await call.trailing_metadata())
                assert trailers["x-tokenmesh-resumed"] == "1"
        # Every stream ended: the worker stops, exit 1 (its engine is gone).
        assert await asyncio.to_thread(dying.process.wait, 60) == 1
        log = dying.log_path.read_text(errors="replace")
        assert log.count("resuming the stream on another worker") == 8
    finally:
        dying.stop()


def test_engine_args_reach_vllms_configuration(worker: ServiceProcess) -> None:
    """The session's worker has TOKENMESH_WORKER_ENGINE_ARGS (conftest): vLLM logs the
    configuration its engine was built with."""
    configured = [
        line
        for line in worker.log_path.read_text(errors="replace").splitlines()
        if "Initializing a V1 LLM engine" in line
    ]
    assert configured, "vLLM logged no engine configuration"
    assert all(
        f", {name}={value}," in configured[-1] for name, value in WORKER_ENGINE_ARGS.items()
    ), configured[-1]


def test_the_engine_neither_saves_nor_fails_to_load_an_ahead_of_time_compile(
    worker: ServiceProcess,
) -> None:
    """On CPU the worker leaves vLLM's ahead-of-time compile cache off (engine.py: the pinned
    vLLM cannot reload what it saves, so every start paid a failed load and a save)."""
    log = worker.log_path.read_text(errors="replace")
    assert "Initializing a V1 LLM engine" in log, "vLLM logged no engine start"
    assert "saved AOT compiled function" not in log
    assert "due to a load failure" not in log


@pytest.mark.parametrize(
    ("engine_args", "named"),
    [
        ({"no_such_argument": 1}, "no_such_argument"),
        ({"kv_cache_dtype": "fp9"}, "kv_cache_dtype"),
    ],
)
def test_a_wrong_engine_argument_stops_the_worker_before_anything_starts(
    engine_args: dict[str, object], named: str
) -> None:
    worker = worker_process(
        ROOT / ".run" / "test-logs",
        name=f"worker-engine-args-{named}",
        engine_args=json.dumps(engine_args),
    )
    worker.start()
    try:
        assert worker.process is not None
        # Importing vLLM takes seconds; no model loads, no engine process starts.
        code = worker.process.wait(timeout=120)
    finally:
        worker.stop()
    log = worker.log_tail()
    assert code == 2, log
    assert f"engine argument {named}:" in log
    assert "Initializing a V1 LLM engine" not in log and "SERVING" not in log
