"""Garbage at the edge, on the whole mesh: thousands of random and malformed requests (PyPI
hypothesis) each end OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED within a deadline, and afterwards
no process has restarted, every service is SERVING and the engines are empty; oversized
messages and headers are refused at once; prompt and document text never reaches a log."""

from __future__ import annotations

import os
import random
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.support import ENVOY, envoy_env, free_port, health_status
from tokenmesh.common.processes import stop_process
from tokenmesh.localmesh.mesh import LocalMesh, envoy_hosts
from tokenmesh.meshconfig.__main__ import render_yaml
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, llm_pb2

pytestmark = pytest.mark.integration


# What a client may see for any request, however malformed: UNAUTHENTICATED is not among them
# (the session mesh runs without keys; test_security covers refusals of keys).
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
# Every call has a deadline: a hang fails as DEADLINE_EXCEEDED instead of stalling the test.
CALL_TIMEOUT_SECONDS = 60.0
# Requests per hypothesis example, sent at once; examples (TOKENMESH_FUZZ_EXAMPLES) x batch.
BATCH = 20
EXAMPLES = int(os.environ.get("TOKENMESH_FUZZ_EXAMPLES", "100"))
SERVICE = "/tokenmesh.v1.LLMService/"
# Each method's shape: (request streaming, response streaming).
SHAPES = {
    "Generate": (False, True),
    "GetAnswer": (False, False),
    "Summarize": (True, False),
    "Chat": (True, True),
}


@dataclass(frozen=True)
class Case:
    """One call: a method and its request body (or bodies, for client streams) as bytes."""

    method: str
    bodies: tuple[bytes, ...]


# Strings: short, empty, huge (one character repeated up to past the message cap), any
# Unicode a proto3 string can hold (not lone surrogates; invalid UTF-8 comes as raw bytes).
characters = st.characters(codec="utf-8")
texts = st.one_of(
    st.text(characters, max_size=40),
    st.builds(lambda char, count: char * count, characters, st.integers(0, 300_000)),
)
# Small valid max_tokens (generations stay short) or values past every bound.
max_tokens = st.one_of(st.integers(1, 4), st.sampled_from([0, -1, 4097, 2**31 - 1, -(2**31)]))
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
int32s = st.integers(-(2**31), 2**31 - 1)
repeated = st.one_of(
    st.lists(texts, max_size=10),
    st.builds(
        lambda text, count: [text] * count, st.text(characters, max_size=3), st.integers(0, 5_000)
    ),
)
# A field number no message defines (parsed and kept as an unknown field).
UNKNOWN_FIELD = b"\xf8\x06\x01"


def sampling(**extra: Any) -> Any:
    return st.fixed_dictionaries(
        {"max_tokens": max_tokens},
        optional={"temperature": floats, **extra},
    )


generate_fields = sampling(
    top_p=floats,
    seed=st.integers(-(2**63), 2**63 - 1),
    stop=repeated,
    documents=repeated,
    top_k_documents=int32s,
    logprobs=st.booleans(),
    top_logprobs=int32s,
).flatmap(lambda fields: st.fixed_dictionaries({"prompt": texts}).map(lambda p: fields | p))


def serialized(message: Any, unknown: bool) -> bytes:
    return message.SerializeToString() + (UNKNOWN_FIELD if unknown else b"")


generates = st.builds(
    lambda fields, method, unknown: Case(
        method,
        (
            serialized(
                (llm_pb2.GenerateRequest if method == "Generate" else llm_pb2.Query)(
                    **{k: v for k, v in fields.items() if method == "Generate" or "logprobs"
                       not in k}
                ),
                unknown,
            ),
        ),
    ),
    generate_fields,
    st.sampled_from(["Generate", "GetAnswer"]),
    st.booleans(),
)  # fmt: skip
chunks = st.lists(
    st.builds(
        lambda text, instruction, fields: llm_pb2.DocumentChunk(
            text=text, instruction=instruction, **fields
        ).SerializeToString(),
        texts,
        st.one_of(st.just(""), texts),
        sampling(),
    ),
    max_size=6,
)
summaries = st.builds(lambda bodies: Case("Summarize", tuple(bodies)), chunks)
chat_messages = st.one_of(
    st.builds(
        lambda content, fields, ignore_eos: llm_pb2.ChatMessage(
            user=llm_pb2.UserTurn(content=content, ignore_eos=ignore_eos, **fields)
        ).SerializeToString(),
        texts,
        sampling(),
        st.booleans(),
    ),
    st.just(llm_pb2.ChatMessage(cancel=llm_pb2.CancelGeneration()).SerializeToString()),
    st.just(llm_pb2.ChatMessage().SerializeToString()),  # neither user nor cancel
)
chats = st.builds(lambda bodies: Case("Chat", tuple(bodies)), st.lists(chat_messages, max_size=12))
# Not protobuf at all, or protobuf of the wrong shape (invalid UTF-8 in string fields too).
garbage = st.builds(
    lambda method, bodies: Case(method, tuple(bodies)),
    st.sampled_from(sorted(SHAPES)),
    st.lists(st.binary(max_size=2_000), min_size=1, max_size=3),
)
cases = st.one_of(generates, summaries, chats, garbage)


def call(channel: grpc.Channel, case: Case) -> grpc.StatusCode:
    """Send case through the edge with raw bytes (no serializer), read everything back."""
    request_streaming, response_streaming = SHAPES[case.method]
    path = SERVICE + case.method
    timeout = CALL_TIMEOUT_SECONDS
    try:
        if request_streaming and response_streaming:
            for _ in channel.stream_stream(path)(iter(case.bodies), timeout=timeout):
                pass
        elif request_streaming:
            channel.stream_unary(path)(iter(case.bodies), timeout=timeout)
        elif response_streaming:
            for _ in channel.unary_stream(path)(case.bodies[0], timeout=timeout):
                pass
        else:
            channel.unary_unary(path)(case.bodies[0], timeout=timeout)
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def pids(local_mesh: LocalMesh) -> dict[str, int]:
    return {program.name: local_mesh.pid(program.name) for program in local_mesh.programs}


def engines_empty(local_mesh: LocalMesh, within: float = 30.0) -> None:
    """Every worker's vLLM scheduler reports nothing running or waiting within `within`."""
    for worker in (program for program in local_mesh.programs if program.service == "worker"):
        with grpc.insecure_channel(worker.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            deadline = time.monotonic() + within
            while True:
                report = stub.GetEngineStats(inference_pb2.EngineStatsRequest(), timeout=30)
                if not (report.running_requests or report.waiting_requests):
                    break
                assert time.monotonic() < deadline, f"{worker.name} not empty: {report}"
                time.sleep(0.05)


@pytest.fixture(scope="module")
def edge(mesh: LocalMesh) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{mesh.settings.edge_port}") as channel:
        yield channel


def test_random_and_garbage_requests_get_clean_statuses_and_break_nothing(
    mesh: LocalMesh, edge: grpc.Channel
) -> None:
    before = pids(mesh)
    seen: dict[str, int] = {}
    bad: list[tuple[grpc.StatusCode, Case]] = []
    pool = ThreadPoolExecutor(8)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        # No shrinking: each example costs real calls, and a failing batch is reported whole.
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.lists(cases, min_size=BATCH, max_size=BATCH))
    def send(batch: list[Case]) -> None:
        statuses = list(pool.map(lambda case: call(edge, case), batch))
        for case, status in zip(batch, statuses, strict=True):
            seen[status.name] = seen.get(status.name, 0) + 1
            if status not in ALLOWED:
                bad.append((status, case))

    try:
        send()
    finally:
        pool.shutdown()
    print(f"statuses over {sum(seen.values())} requests: {seen}")
    assert not bad, [
        (status, case.method, [b[:200] for b in case.bodies]) for status, case in bad[:5]
    ]
    # Both kinds of outcome happened: the fuzz reached the engines and the validators.
    assert seen.get("OK", 0) > 50 and seen.get("INVALID_ARGUMENT", 0) > 50
    assert pids(mesh) == before, "a process restarted"
    for program in mesh.programs:
        if program.port is not None:
            assert health_status(program.address, timeout=5) == "SERVING", program.name
    engines_empty(mesh)


def test_a_message_over_the_gateway_cap_is_refused_at_once(edge: grpc.Channel) -> None:
    request = llm_pb2.GenerateRequest(prompt="x" * (2 * 1024 * 1024), max_tokens=1)
    begun = time.monotonic()
    status = call(edge, Case("Generate", (request.SerializeToString(),)))
    assert status is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - begun < 10


@pytest.mark.parametrize(
    ("metadata", "status"),
    [
        # Over max_request_headers_kib (60): HTTP/2 header decoding fails for the connection
        # (GOAWAY), so gRPC reports UNAVAILABLE; the channel reconnects for its next call.
        ((("x-big", "a" * 70 * 1024),), grpc.StatusCode.UNAVAILABLE),
        # Over max_headers_count (100): only this stream is reset (RST_STREAM), INTERNAL.
        (tuple((f"x-many-{i}", "1") for i in range(120)), grpc.StatusCode.INTERNAL),
    ],
    ids=["oversized", "too-many"],
)
def test_oversized_request_headers_are_refused_at_the_edge(
    edge: grpc.Channel, metadata: tuple[tuple[str, str], ...], status: grpc.StatusCode
) -> None:
    generate = edge.unary_stream(SERVICE + "Generate")
    body = llm_pb2.GenerateRequest(prompt="hi", max_tokens=1).SerializeToString()
    begun = time.monotonic()
    with pytest.raises(grpc.RpcError) as error:
        list(generate(body, metadata=metadata, timeout=30))
    assert error.value.code() is status, error.value.details()
    assert time.monotonic() - begun < 10
    # The edge still serves this channel's next call.
    assert call(edge, Case("Generate", (body,))) is grpc.StatusCode.OK


def test_prompts_and_documents_never_reach_a_log(mesh: LocalMesh, edge: grpc.Channel) -> None:
    """A marker in every text field of every call shape (valid and refused requests) through
    the edge; afterwards no log file of the mesh holds it."""
    marker = f"secret-{uuid.uuid4().hex}"
    documents = [f"{marker} document {i}" for i in range(3)]
    generate = llm_pb2.GenerateRequest(
        prompt=f"{marker} prompt", max_tokens=4, documents=documents, stop=[marker]
    ).SerializeToString()
    chunk = llm_pb2.DocumentChunk(text=marker, instruction=marker, max_tokens=4)
    turn = llm_pb2.ChatMessage(user=llm_pb2.UserTurn(content=marker, max_tokens=4))
    # Refused: a document over its limit.
    refused = llm_pb2.GenerateRequest(prompt=marker, max_tokens=4, documents=[marker * 1000])
    cases = [
        Case("Generate", (generate,)),
        Case("GetAnswer", (generate,)),
        Case("Summarize", (chunk.SerializeToString(),)),
        Case("Chat", (turn.SerializeToString(),)),
        Case("Generate", (refused.SerializeToString(),)),
    ]
    statuses = [call(edge, case) for case in cases]
    assert statuses[:4] == [grpc.StatusCode.OK] * 4
    assert statuses[4] is grpc.StatusCode.INVALID_ARGUMENT
    time.sleep(1.0)  # supervisord writes the processes' output to their files
    holders = [
        path.name
        for path in mesh.log_dir.rglob("*")
        if path.is_file() and marker.encode() in path.read_bytes()
    ]
    assert not holders, f"the marker is in {holders}"


def test_edge_rate_limit_refuses_grpc_with_resource_exhausted(
    mesh: LocalMesh, tmp_path: Path
) -> None:
    """A second Envoy, rendered with a tiny edge bucket (1/s, burst 2), in front of the same
    gateways (endpoints from the mesh's control plane): a burst of calls gets 2 through and
    the rest refused RESOURCE_EXHAUSTED with retry-after-ms, at once."""
    ports = [free_port() for _ in range(4)]
    limited = MeshSettings(
        edge_port=ports[0],
        admin_port=ports[1],
        worker_listener_port=ports[2],
        reranker_listener_port=ports[3],
        controlplane_port=mesh.settings.controlplane_port,
        ops_page_port=mesh.settings.controlplane_ops_page_port,
        node_id="tokenmesh-envoy-rate-limited",
        edge_rate_limit_per_second=1,
        edge_rate_burst=2,
    )
    config = tmp_path / "envoy.yaml"
    config.write_text(render_yaml(limited))
    envoy = subprocess.Popen(
        [ENVOY or "envoy", "-c", str(config), "--base-id", str(random.randint(60_001, 65_000)),
         "--log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=envoy_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not any(ok for _, ok in envoy_hosts(limited.admin_port).get("gateway", [])):
            assert time.monotonic() < deadline, "the second Envoy found no healthy gateway"
            time.sleep(0.2)
        body = llm_pb2.GenerateRequest(prompt="hi", max_tokens=1).SerializeToString()
        with grpc.insecure_channel(f"127.0.0.1:{limited.edge_port}") as channel:
            generate = channel.unary_stream(SERVICE + "Generate")
            codes, hints = [], []
            begun = time.monotonic()
            for _ in range(6):
                call = generate(body, timeout=30)
                try:
                    list(call)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError:
                    codes.append(call.code())
                    # A trailers-only response: its headers are the trailers.
                    metadata = (*(call.initial_metadata() or ()), *(call.trailing_metadata() or ()))
                    hints.append(dict(metadata).get("retry-after-ms"))
            took = time.monotonic() - begun
    finally:
        stop_process(envoy, 30)
    # The bucket starts full (2) and refills 1/s: at most 2 + the seconds taken get through.
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 6 - 2 - int(took) - 1, codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert codes[0] is grpc.StatusCode.OK
    assert hints and set(hints) == {"1000"}
