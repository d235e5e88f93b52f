"""The gateway as Envoy's external processor for OpenAI completions: the worker's request it
prepares, the requests it hands back to its own HTTP API, and a worker's refusal answered in
OpenAI's shape."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.api import httpbody_pb2
from prometheus_client import CollectorRegistry

from tests.unit.test_extproc import Prepared, headers, set_headers
from tokenmesh.common.pools import POOL_HEADER
from tokenmesh.common.presentation import answer_extra
from tokenmesh.common.tokens import (
    OPENAI_CHAT_COMPLETIONS,
    OPENAI_COMPLETIONS,
    ROUTE_HEADER,
    WORKER_GENERATE_OPENAI,
    WORKER_HEADER,
    WORKER_REFUSED,
)
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.catalog import ModelNotFound, Served
from tokenmesh.gateway.frontends.extproc import (
    DirectMetrics,
    ExternalProcessor,
    answered,
    grpc_frame,
    single_message,
)
from tokenmesh.gateway.frontends.openai.prepare import OpenAIPreparer
from tokenmesh.v1 import inference_pb2

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


class Catalog:
    """The served model's name, without a worker to ask."""

    async def resolve(self, requested: str, allowed: Any = None) -> Served:
        if requested != MODEL:
            raise ModelNotFound(f"the model {requested!r} does not exist")
        return Served(MODEL)


def body(fields: dict[str, Any]) -> ext_proc.ProcessingRequest:
    caller = httpbody_pb2.HttpBody(
        content_type="application/json", data=json.dumps(fields).encode()
    )
    return ext_proc.ProcessingRequest(
        request_body=ext_proc.HttpBody(
            body=grpc_frame(caller.SerializeToString()), end_of_stream=True
        )
    )


async def replies(
    pipeline: Prepared, *messages: ext_proc.ProcessingRequest
) -> tuple[list[Any], DirectMetrics]:
    registry = CollectorRegistry()
    settings = GatewaySettings()
    openai = OpenAIPreparer(pipeline.preparer, Catalog(), settings)  # type: ignore[arg-type]
    metrics = DirectMetrics(registry)
    processor = ExternalProcessor(
        pipeline.preparer, settings, metrics, None, openai, pipeline.metered
    )

    async def requests() -> AsyncIterator[ext_proc.ProcessingRequest]:
        for message in messages:
            yield message

    return [reply async for reply in processor.Process(requests(), None)], metrics


def response_headers(**values: str) -> ext_proc.ProcessingRequest:
    header_values = [
        base_pb2.HeaderValue(key=k.replace("_", "-"), raw_value=v.encode())
        for k, v in values.items()
    ]
    return ext_proc.ProcessingRequest(
        response_headers=ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=header_values))
    )


async def test_a_chat_is_prepared_for_a_worker_to_answer_in_openais_shape() -> None:
    pipeline = Prepared(warnings=("reranker_unavailable: UNAVAILABLE",))
    request = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    found, metrics = await replies(pipeline, headers(OPENAI_CHAT_COMPLETIONS), body(request))
    first, second = found
    assert first.request_headers == ext_proc.HeadersResponse()
    common = second.request_body.response
    assert common.clear_route_cache
    rewritten = set_headers(common.header_mutation)
    assert rewritten[":path"] == WORKER_GENERATE_OPENAI
    assert rewritten[ROUTE_HEADER] == "/v1/chat/completions"
    limit = GatewaySettings().http_request_timeout_seconds
    assert rewritten["grpc-timeout"] == f"{int(limit) + 5}S"
    assert list(common.header_mutation.remove_headers) == [WORKER_HEADER, POOL_HEADER]
    data = single_message(common.body_mutation.body)
    assert data is not None
    worker = inference_pb2.InferenceRequest.FromString(data)
    assert [(m.role, m.content) for m in worker.messages] == [("user", "hi")]
    assert worker.sampling.max_tokens == 5
    assert not worker.sampling.max_tokens_within_context
    assert list(worker.warnings) == ["reranker_unavailable: UNAVAILABLE"]
    answer = worker.openai
    assert answer.chat and answer.stream and answer.include_usage
    assert answer.time_limit_seconds == limit
    assert answer.model == MODEL and answer.id.startswith("chatcmpl-") and answer.created > 0
    assert worker.degraded == "reranker"
    assert answer_extra(worker)["tokenmesh"]["warnings"] == ["reranker_unavailable: UNAVAILABLE"]
    assert metrics.requests.labels(api="openai", outcome="direct")._value.get() == 1


async def test_a_completion_is_prepared_whole_without_a_stream() -> None:
    request = {"model": MODEL, "prompt": "say", "max_tokens": 3, "logprobs": 2}
    found, _ = await replies(Prepared(), headers(OPENAI_COMPLETIONS), body(request))
    common = found[1].request_body.response
    assert set_headers(common.header_mutation)[ROUTE_HEADER] == "/v1/completions"
    data = single_message(common.body_mutation.body)
    assert data is not None
    worker = inference_pb2.InferenceRequest.FromString(data)
    assert worker.prompt == "say"
    assert worker.sampling.logprobs and worker.sampling.top_logprobs == 2
    assert not worker.openai.chat and not worker.openai.stream
    assert worker.openai.id.startswith("cmpl-")


async def test_requests_the_gateway_must_see_or_refuses_are_handed_back_as_sent() -> None:
    """Keys on (quotas count its tokens), an unknown model, an unsupported field: the caller's
    own request goes to the gateway's HTTP API, which answers it in OpenAI's shape."""
    cases = [
        (Prepared(metered=True), CHAT),
        (Prepared(), {**CHAT, "model": "other"}),
        (Prepared(), {**CHAT, "echo": True}),
    ]
    for pipeline, request in cases:
        found, metrics = await replies(pipeline, headers(OPENAI_CHAT_COMPLETIONS), body(request))
        assert len(found) == 2, request  # the stream ends: nothing more to see
        common = found[1].request_body.response
        assert common.clear_route_cache
        rewritten = set_headers(common.header_mutation)
        assert rewritten[":path"] == "/v1/chat/completions"
        assert rewritten["content-type"] == "application/json"
        assert list(common.header_mutation.remove_headers) == ["te"]
        assert json.loads(common.body_mutation.body) == request
        assert metrics.requests.labels(api="openai", outcome="gateway")._value.get() == 1


async def test_the_workers_headers_are_seen_and_a_refusal_answered_in_openais_shape() -> None:
    found, _ = await replies(
        Prepared(),
        headers(OPENAI_CHAT_COMPLETIONS),
        body(CHAT),
        response_headers(
            **{":status": "200", "grpc-status": "3", "grpc-message": "prompt: too long%21"}
        ),
    )
    refusal = found[2].immediate_response
    assert refusal.status.code == 400
    assert refusal.details == WORKER_REFUSED
    assert json.loads(refusal.body) == {
        "error": {
            "message": "prompt: too long!",
            "type": "invalid_request_error",
            # The field the worker named.
            "param": "prompt",
            "code": None,
        }
    }
    assert set_headers(refusal.headers)["content-type"] == "application/json"


def test_an_answer_goes_on_and_an_overloaded_worker_is_a_503_with_retry_after() -> None:
    for values in ({":status": "200"}, {":status": "200", "grpc-status": "0"}):
        assert answered(values).response_headers == ext_proc.HeadersResponse()
    full = answered({":status": "200", "grpc-status": "8", "grpc-message": "queue full"})
    assert full.immediate_response.status.code == 503
    added = set_headers(full.immediate_response.headers)
    assert added["retry-after"] == "1" and added["retry-after-ms"] == "1000"
    gone = answered({":status": "200", "grpc-status": "14", "grpc-message": "no worker"})
    assert gone.immediate_response.status.code == 503
    assert json.loads(gone.immediate_response.body)["error"]["message"] == "no worker"
