"""Envoy's own replies, reshaped for whoever reads them: OpenAI's error object on OpenAI's paths,
and on the direct token path a message saying why, with the status a gRPC caller expects."""

from __future__ import annotations

from tokenmesh.common.errors import error_body
from tokenmesh.common.tokens import OPENAI_SERVICE, WORKER_GENERATE_OPENAI, WORKER_REFUSED
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.constants import OPENAI_PREFIX, TOKENIZER_PATHS, TYPE, Config

# Envoy's own replies on OpenAI's paths, by status range (low, high), each answered as the
# gateway answers the status named (error_body(): OpenAI's error type for it); a client error
# the gateway never sends (408, 413, 431) is an invalid request.
OPENAI_REPLY_STATUSES = (
    (401, 401, 401),
    (403, 403, 403),
    (404, 404, 404),
    (429, 429, 429),
    (400, 499, 400),
    (500, 502, 500),
    (503, 599, 503),
)
# Why a request failed when no gateway could prepare it for the workers.
PREPARE_FAILED = "no gateway prepared the request"
# Envoy's details when the external processor failed, and when it did not answer in time.
PROCESSOR_FAILED = "response.code_details.startsWith('ext_proc_error')"
PROCESSOR_TIMED_OUT = "response.code_details == 'ext_proc_error_per-message_timeout_exceeded'"


def code_details(expression: str) -> Config:
    """A local reply mapper's filter on why Envoy answered itself (%RESPONSE_CODE_DETAILS%,
    `response.code_details` in CEL: no other filter reads it)."""
    return {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": TYPE + "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                "expression": expression,
            },
        }
    }


def status_filter(op: str, status: int) -> Config:
    return {
        "status_code_filter": {
            "comparison": {
                "op": op,
                "value": {"default_value": status, "runtime_key": f"edge_{op.lower()}_{status}"},
            }
        }
    }


def edge_local_replies(mesh: MeshSettings) -> Config:
    """Envoy's own answers, in the shape each caller reads: OpenAI's error object on OpenAI's
    paths (first: their 413 is not gRPC's), then the direct token path's messages."""
    mappers = openai_local_replies(mesh) + direct_local_replies(mesh)
    return {"local_reply_config": {"mappers": mappers}} if mappers else {}


def openai_local_replies(mesh: MeshSettings) -> list[Config]:
    """With openai_api: what Envoy answers itself on OpenAI's paths (no healthy gateway, the
    edge's rate limit, an overflowing circuit breaker, a timeout, a body too large) becomes
    the gateway's own error_body(), with Envoy's reason as the message and application/json,
    so SDKs raise their usual errors. Local reply mappers never touch an upstream's answer:
    a gateway's own errors pass as they are."""
    if not mesh.openai_api:
        return []
    paths = [{"prefix": OPENAI_PREFIX}, *({"exact": path} for path in TOKENIZER_PATHS)]
    if mesh.direct_token_path:
        # The paths OpenAI's requests have once transcoded, and once prepared for a worker.
        paths += [{"prefix": f"/{OPENAI_SERVICE}/"}, {"exact": WORKER_GENERATE_OPENAI}]
    filters = [
        {"header_filter": {"header": {"name": ":path", "string_match": match}}} for match in paths
    ]
    on_openai_paths = filters[0] if len(filters) == 1 else {"or_filter": {"filters": filters}}
    # A worker's refusal, which the external processor has already answered in OpenAI's
    # shape (gateway/frontends/extproc.py), is kept as it is.
    mappers: list[Config] = [
        {"filter": code_details(f"response.code_details == '{WORKER_REFUSED}'")}
    ]
    if mesh.direct_token_path:
        # No gateway to prepare a completion: why, as the gRPC path says it.
        mappers.append(
            {
                "filter": {
                    "and_filter": {"filters": [on_openai_paths, code_details(PROCESSOR_FAILED)]}
                },
                "body_format_override": {
                    "json_format": error_body(
                        f"{PREPARE_FAILED} (%RESPONSE_CODE_DETAILS%); retry", 503
                    )
                },
            }
        )
    for low, high, status in OPENAI_REPLY_STATUSES:
        statuses = (
            [status_filter("EQ", low)]
            if low == high
            else [status_filter("GE", low), status_filter("LE", high)]
        )
        mappers.append(
            {
                "filter": {"and_filter": {"filters": [on_openai_paths, *statuses]}},
                "body_format_override": {"json_format": error_body("%LOCAL_REPLY_BODY%", status)},
            }
        )
    return mappers


def direct_local_replies(mesh: MeshSettings) -> list[Config]:
    """With the direct token path, Envoy's own answers get the message a caller needs. A
    request body over the edge's buffer (only the external processor buffers a gRPC body
    whole; every valid request fits with the default limits) is refused with HTTP 413, which
    gRPC would read as UNKNOWN: RESOURCE_EXHAUSTED with a message, as the gateways refuse a
    message over their cap. A request no gateway prepared fails UNAVAILABLE (HTTP 503/504:
    retry), which Envoy sends without a message: it says why, and names the limit."""
    if not mesh.direct_token_path:
        return []
    return [
        {
            "filter": code_details(PROCESSOR_TIMED_OUT),
            "body": {
                "inline_string": (
                    f"{PREPARE_FAILED} within the edge's prepare_timeout_seconds "
                    f"({mesh.prepare_timeout_seconds:g} s); retry"
                )
            },
        },
        {
            "filter": code_details(PROCESSOR_FAILED),
            "body_format_override": {
                "text_format_source": {
                    "inline_string": f"{PREPARE_FAILED} (%RESPONSE_CODE_DETAILS%); retry"
                }
            },
        },
        {
            "filter": status_filter("EQ", 413),
            "headers_to_add": [
                {
                    "header": {"key": "grpc-status", "value": "8"},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                }
            ],
            "body": {
                "inline_string": (
                    f"request: the body is over the edge's limit of {mesh.buffer_limit_bytes} bytes"
                )
            },
        },
    ]
