"""The gateway as Envoy's external processor: gRPC framing, deadlines, and the replies that
rewrite a Generate request for the workers or refuse it."""

from __future__ import annotations

import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from prometheus_client import CollectorRegistry

from tokenmesh.common.channels import Dependency
from tokenmesh.common.tokens import (
    AFFINITY_HEADER,
    CALLER_CONTENT_TYPE,
    DEGRADED_HEADER,
    EDGE_METADATA,
    LLM_GENERATE,
    WORKER_GENERATE,
    WORKER_HEADER,
)
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.catalog import ModelCatalog
from tokenmesh.gateway.core.documents import Selection
from tokenmesh.gateway.core.prefix_key import affinity_key
from tokenmesh.gateway.core.prepare import Preparer
from tokenmesh.gateway.frontends.extproc import (
    DirectMetrics,
    ExternalProcessor,
    grpc_frame,
    grpc_timeout,
    single_message,
)
from tokenmesh.v1 import inference_pb2, llm_pb2


def test_a_unary_body_holds_exactly_one_uncompressed_message() -> None:
    message = llm_pb2.GenerateRequest(prompt="hi").SerializeToString()
    assert single_message(grpc_frame(message)) == message
    assert single_message(grpc_frame(b"")) == b""
    assert single_message(b"\x01" + grpc_frame(message)[1:]) is None  # compressed
    assert single_message(grpc_frame(message)[:-1]) is None  # cut short
    assert single_message(grpc_frame(message) * 2) is None
    assert single_message(b"\x00\x00") is None


def test_grpc_timeout_headers_in_every_unit() -> None:
    assert grpc_timeout("100m") == 0.1
    assert grpc_timeout("5S") == 5.0
    assert grpc_timeout("2M") == 120.0
    assert grpc_timeout("1H") == 3600.0
    assert grpc_timeout("250000u") == 0.25
    for value in (None, "", "S", "10", "1.5S", "-1S", "5s"):
        assert grpc_timeout(value) is None, value


class Selector:
    """Chooses no documents, with fixed warnings (the processor's own logic is under test, not
    the reranker's), and keeps the time each call was given."""

    def __init__(self, warnings: tuple[str, ...]) -> None:
        self.warnings = warnings
        self.remaining: list[float | None] = []

    async def select(
        self, query: str, documents: Any, top_k: int, remaining: float | None
    ) -> Selection:
        self.remaining.append(remaining)
        return Selection((), self.warnings)


class Picker:
    def __init__(self, picked: tuple[str, ...]) -> None:
        self.picked = picked

    def pick(self, key: str, pool: str = "", adapter: str = "") -> list[str]:
        return list(self.picked)


class Prepared:
    """The gateway's real preparation over a fixed selector (and endpoint picker, when it
    names workers), and whether quotas are on."""

    def __init__(
        self, warnings: tuple[str, ...] = (), metered: bool = False, picked: tuple[str, ...] = ()
    ) -> None:
        self.selector = Selector(warnings)
        self.metered = metered
        picker = Picker(picked) if picked else None
        # A catalog with no worker behind it: these requests name no model, so it asks none.
        catalog = ModelCatalog(Dependency("worker", "127.0.0.1:1", 1 << 20), timeout=1.0)
        self.preparer = Preparer(self.selector, GatewaySettings(), catalog, picker)

    @property
    def remaining(self) -> list[float | None]:
        return self.selector.remaining


def headers(path: str, **extra: str) -> ext_proc.ProcessingRequest:
    values = [base_pb2.HeaderValue(key=":path", raw_value=path.encode())]
    values += [
        base_pb2.HeaderValue(key=k.replace("_", "-"), raw_value=v.encode())
        for k, v in extra.items()
    ]
    return ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=values))
    )


def body(request: llm_pb2.GenerateRequest) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(
        request_body=ext_proc.HttpBody(
            body=grpc_frame(request.SerializeToString()), end_of_stream=True
        )
    )


async def replies(
    pipeline: Any, *messages: ext_proc.ProcessingRequest, metrics: DirectMetrics | None = None
) -> list[Any]:
    metrics = metrics or DirectMetrics(CollectorRegistry())
    processor = ExternalProcessor(
        pipeline.preparer, GatewaySettings(), metrics, metered=pipeline.metered
    )

    async def requests() -> AsyncIterator[ext_proc.ProcessingRequest]:
        for message in messages:
            yield message

    return [reply async for reply in processor.Process(requests(), None)]


def set_headers(mutation: ext_proc.HeaderMutation) -> dict[str, str]:
    return {option.header.key: option.header.raw_value.decode() for option in mutation.set_headers}


async def test_generate_is_rewritten_into_the_workers_request() -> None:
    pipeline = Prepared(warnings=("reranker_unavailable: UNAVAILABLE",))
    request = llm_pb2.GenerateRequest(prompt="question", max_tokens=7, ignore_eos=True)
    first, second = await replies(pipeline, headers(LLM_GENERATE, grpc_timeout="2S"), body(request))
    assert first.request_headers == ext_proc.HeadersResponse()  # the body is awaited
    common = second.request_body.response
    assert common.clear_route_cache
    rewritten = set_headers(common.header_mutation)
    assert rewritten[":path"] == WORKER_GENERATE
    # Envoy places it by the prepared prompt's prefix (worker_routing prefix).
    assert rewritten[AFFINITY_HEADER] == affinity_key("question", 1024)
    # The reranker call gets what is left of the 2 s; the worker the caller's own grpc-timeout.
    assert pipeline.remaining and 0 < (pipeline.remaining[0] or 0) <= 2.0
    assert "grpc-timeout" not in rewritten
    worker = inference_pb2.InferenceRequest.FromString(single_message(common.body_mutation.body))
    assert worker.prompt == "question"
    assert worker.sampling.max_tokens == 7 and worker.sampling.ignore_eos
    # The worker presents both: the warnings on the first token, the marker as a trailer.
    assert list(worker.warnings) == ["reranker_unavailable: UNAVAILABLE"]
    assert worker.degraded == "reranker"


async def test_the_pickers_workers_go_with_the_request_and_a_callers_own_never_do() -> None:
    request = llm_pb2.GenerateRequest(prompt="question", max_tokens=3)
    caller = {"x_tokenmesh_worker": "10.0.0.9:1"}
    _, picked = await replies(
        Prepared(picked=("10.0.0.2:50061", "10.0.0.1:50061")),
        headers(LLM_GENERATE, **caller),
        body(request),
    )
    mutation = picked.request_body.response.header_mutation
    # Envoy's override-host policy tries them in this order (worker_routing picker).
    assert set_headers(mutation)[WORKER_HEADER] == "10.0.0.2:50061,10.0.0.1:50061"
    _, unpicked = await replies(Prepared(), headers(LLM_GENERATE, **caller), body(request))
    mutation = unpicked.request_body.response.header_mutation
    assert WORKER_HEADER not in set_headers(mutation)
    assert WORKER_HEADER in mutation.remove_headers


async def test_only_the_preparation_marks_an_answer_degraded_never_a_caller() -> None:
    request = llm_pb2.GenerateRequest(prompt="question", max_tokens=3)
    _, second = await replies(
        Prepared(), headers(LLM_GENERATE, x_tokenmesh_degraded="reranker"), body(request)
    )
    common = second.request_body.response
    assert DEGRADED_HEADER not in set_headers(common.header_mutation)
    worker = inference_pb2.InferenceRequest.FromString(single_message(common.body_mutation.body))
    assert worker.degraded == "" and not worker.warnings


async def test_a_request_the_gateway_would_refuse_goes_on_to_its_own_handler() -> None:
    """Refusals stay the gateway handler's, with the status and message it gives on every
    protocol: the request continues unchanged (routed to the gateways)."""
    metrics = DirectMetrics(CollectorRegistry())
    too_many = llm_pb2.GenerateRequest(prompt="question", max_tokens=10**6)
    garbage = ext_proc.ProcessingRequest(
        request_body=ext_proc.HttpBody(body=grpc_frame(b"\xff\xff\xff"), end_of_stream=True)
    )
    compressed = ext_proc.ProcessingRequest(
        request_body=ext_proc.HttpBody(body=b"\x01" + grpc_frame(b"x")[1:], end_of_stream=True)
    )
    # Over the edge's buffer: Envoy sends the body's start, its end still to come.
    valid = llm_pb2.GenerateRequest(prompt="question", max_tokens=3)
    partial = ext_proc.ProcessingRequest(
        request_body=ext_proc.HttpBody(body=grpc_frame(valid.SerializeToString()))
    )
    for request in (body(too_many), garbage, compressed, partial):
        _, reply = await replies(Prepared(), headers(LLM_GENERATE), request, metrics=metrics)
        assert reply.request_body == ext_proc.BodyResponse()  # unchanged, to the gateways
    # Quotas on: the headers go on and the stream ends, before any body is asked for.
    metered = Prepared(metered=True)
    request = llm_pb2.GenerateRequest(prompt="question", max_tokens=3)
    only = await replies(metered, headers(LLM_GENERATE), body(request), metrics=metrics)
    assert [reply.WhichOneof("response") for reply in only] == ["request_headers"]
    assert metered.remaining == []
    assert metrics.requests.labels(api="grpc", outcome="gateway")._value.get() == 5
    assert metrics.requests.labels(api="grpc", outcome="direct")._value.get() == 0


def from_caller(
    message: ext_proc.ProcessingRequest, content_type: str
) -> ext_proc.ProcessingRequest:
    """message with the caller's content-type as the edge keeps it (before gRPC-Web's filter)."""
    message.metadata_context.filter_metadata[EDGE_METADATA].fields[
        CALLER_CONTENT_TYPE
    ].string_value = content_type
    return message


async def test_grpc_web_goes_on_to_the_gateways_own_handler() -> None:
    """Envoy's gRPC-Web filter moves a stream's trailers into its body, where the access log
    never sees them: such a stream takes the gateway's path; gRPC and REST (as gRPC) do not."""
    metrics = DirectMetrics(CollectorRegistry())
    request = llm_pb2.GenerateRequest(prompt="question", max_tokens=3)
    for content_type in ("application/grpc-web+proto", "application/grpc-web-text"):
        only = await replies(
            Prepared(),
            from_caller(headers(LLM_GENERATE), content_type),
            body(request),
            metrics=metrics,
        )
        assert [reply.WhichOneof("response") for reply in only] == ["request_headers"]
    for content_type in ("application/grpc", "application/json"):
        _, reply = await replies(
            Prepared(),
            from_caller(headers(LLM_GENERATE), content_type),
            body(request),
            metrics=metrics,
        )
        assert set_headers(reply.request_body.response.header_mutation)[":path"] == WORKER_GENERATE
    assert metrics.requests.labels(api="grpc", outcome="gateway")._value.get() == 2
    assert metrics.requests.labels(api="grpc", outcome="direct")._value.get() == 2


async def test_other_paths_are_refused_at_once() -> None:
    (refused,) = await replies(Prepared(), headers(WORKER_GENERATE))
    immediate = refused.immediate_response
    assert immediate.grpc_status.status == grpc.StatusCode.UNIMPLEMENTED.value[0]
    assert immediate.status.code == 501
    message = urllib.parse.unquote(set_headers(immediate.headers)["grpc-message"])
    assert message == f"{WORKER_GENERATE}: not served here"
