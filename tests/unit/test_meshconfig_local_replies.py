"""Envoy's own replies: OpenAI's error object on its paths, the direct token path's messages."""

from __future__ import annotations

import itertools
import json

from tests.unit.test_meshconfig import listeners
from tokenmesh.common.errors import error_body
from tokenmesh.common.tokens import WORKER_REFUSED
from tokenmesh.meshconfig.bootstrap import render
from tokenmesh.meshconfig.config import MeshSettings


def test_a_body_over_the_edges_buffer_is_resource_exhausted_for_grpc() -> None:
    """The direct token path buffers Generate's body whole; Envoy refuses a larger one with 413,
    which gRPC reads as UNKNOWN: the edge says RESOURCE_EXHAUSTED (8) and the limit instead."""
    edge = listeners(render(MeshSettings(direct_token_path=True, buffer_limit_bytes=65536)))["edge"]
    *_, mapper = edge["local_reply_config"]["mappers"]
    assert mapper["filter"]["status_code_filter"]["comparison"]["value"]["default_value"] == 413
    assert mapper["headers_to_add"][0]["header"] == {"key": "grpc-status", "value": "8"}
    assert "65536 bytes" in mapper["body"]["inline_string"]
    off = listeners(render(MeshSettings(direct_token_path=False)))["edge"]
    assert "grpc-status" not in json.dumps(off.get("local_reply_config", {}))


def test_a_request_no_gateway_prepared_says_why() -> None:
    """Envoy fails a request its external processor did not prepare with no message: the edge
    names the limit that passed, or the processor's error, and says to retry."""
    settings = MeshSettings(direct_token_path=True, prepare_timeout_seconds=2.5)
    *_, timeout, failed, _ = listeners(render(settings))["edge"]["local_reply_config"]["mappers"]
    expressions = [
        mapper["filter"]["extension_filter"]["typed_config"]["expression"]
        for mapper in (timeout, failed)
    ]
    assert expressions == [
        "response.code_details == 'ext_proc_error_per-message_timeout_exceeded'",
        "response.code_details.startsWith('ext_proc_error')",
    ]
    assert "prepare_timeout_seconds (2.5 s)" in timeout["body"]["inline_string"]
    details = failed["body_format_override"]["text_format_source"]["inline_string"]
    assert "%RESPONSE_CODE_DETAILS%" in details


def first_mapper(mappers: list[dict], path: str, status: int) -> dict | None:
    """The local reply mapper Envoy applies to its own reply with status on path (the filters
    these mappers use; the direct path's CEL filters on response details never match here)."""

    def matches(condition: dict) -> bool:
        if "and_filter" in condition:
            return all(matches(part) for part in condition["and_filter"]["filters"])
        if "or_filter" in condition:
            return any(matches(part) for part in condition["or_filter"]["filters"])
        if "header_filter" in condition:
            header = condition["header_filter"]["header"]
            assert header["name"] == ":path"
            match = header["string_match"]
            return path == match["exact"] if "exact" in match else path.startswith(match["prefix"])
        if "status_code_filter" in condition:
            comparison = condition["status_code_filter"]["comparison"]
            value = comparison["value"]["default_value"]
            return {"EQ": status == value, "GE": status >= value, "LE": status <= value}[
                comparison["op"]
            ]
        return False

    return next((mapper for mapper in mappers if matches(mapper["filter"])), None)


def test_envoys_own_replies_on_openai_paths_are_the_gateways_openai_error_object() -> None:
    """No healthy gateway (503), the edge's rate limit (429), a timeout (504), a body too
    large (413): on /v1/ Envoy answers with error_body(), its reason as the message, the
    gateway's type for each status (any other client error an invalid request); gRPC and REST
    keep Envoy's own replies and the direct token path's 413."""
    mappers = listeners(render(MeshSettings(direct_token_path=True)))["edge"]["local_reply_config"][
        "mappers"
    ]
    named = {400, 401, 403, 404, 429}
    # A worker's refusal the external processor answered in OpenAI's shape stays as it is.
    assert mappers[0] == {
        "filter": {
            "extension_filter": {
                "name": "envoy.access_loggers.extension_filters.cel",
                "typed_config": {
                    "@type": "type.googleapis.com/"
                    "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                    "expression": f"response.code_details == '{WORKER_REFUSED}'",
                },
            }
        }
    }
    # As the caller sent it, as the transcoder made it a call, as prepared for a worker.
    paths = (
        "/v1/chat/completions",
        "/tokenize",
        "/tokenmesh.v1.OpenAIService/ChatCompletions",
        "/tokenmesh.v1.InferenceService/GenerateOpenAI",
    )
    for status, path in itertools.product(range(400, 600), paths):
        mapper = first_mapper(mappers, path, status)
        assert mapper is not None, status
        body = mapper["body_format_override"]["json_format"]
        expected = error_body("%LOCAL_REPLY_BODY%", status)
        if status < 500 and status not in named:
            expected["error"]["type"] = "invalid_request_error"
        assert body == expected, status
        assert body["error"]["param"] is None and body["error"]["code"] is None
        assert "headers_to_add" not in mapper  # no grpc-status on an HTTP/JSON answer
    for path in (
        "/tokenmesh.v1.LLMService/Generate",
        "/tokenmesh.v1.InferenceService/Generate",
        "/v1",
        "/ops/",
        "/tokenizer",
    ):
        for status in (404, 429, 503, 504):
            assert first_mapper(mappers, path, status) is None, (path, status)
    too_large = first_mapper(mappers, "/tokenmesh.v1.LLMService/Generate", 413)
    assert too_large is not None and too_large["headers_to_add"][0]["header"]["value"] == "8"
    off = listeners(render(MeshSettings(openai_api=False, direct_token_path=False)))["edge"]
    assert "local_reply_config" not in off
    only_openai = listeners(render(MeshSettings(direct_token_path=False)))["edge"]
    assert first_mapper(only_openai["local_reply_config"]["mappers"], "/v1/models", 503)
