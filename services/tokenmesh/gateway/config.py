"""Gateway settings, from TOKENMESH_GATEWAY_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import SettingsConfigDict

from tokenmesh.common.pools import pool_names
from tokenmesh.common.sampling import SamplingLimits, ToolLimits
from tokenmesh.common.settings import MIB, ServiceSettings


class BreakerSettings(BaseModel):
    """When the reranker's circuit opens, and how it recovers."""

    model_config = {"frozen": True}

    consecutive_failures: int = Field(
        default=5, ge=1, description="Consecutive failed calls that open the circuit."
    )
    failure_rate: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Or: this fraction of failed calls within the rolling window ...",
    )
    min_calls_in_window: int = Field(
        default=10,
        ge=1,
        description=(
            "... once the window holds at least this many calls (so 1 failure of 1 does not "
            "trip it)."
        ),
    )
    window_seconds: float = Field(
        default=10.0, gt=0, description="The rolling window failure_rate is measured over."
    )
    open_seconds: float = Field(
        default=5.0,
        gt=0,
        description=(
            "How long an open circuit refuses calls (no network wait) before letting probes "
            "through."
        ),
    )
    half_open_max_calls: int = Field(
        default=1,
        ge=1,
        description=(
            "Probe calls let through at once while half-open; their success closes the circuit."
        ),
    )


class PickerSettings(BaseModel):
    """The endpoint picker (worker_routing picker): where the workers' load comes from, and how
    far prefix affinity may outweigh it."""

    model_config = {"frozen": True}

    feed_address: str | None = Field(
        default=None,
        description=(
            "The control plane's gRPC address (host:port), whose OpsService.SubscribeWorkers "
            "feeds the picker every worker's health and engine queue. Unset: no picker; the "
            "gateway names no worker and Envoy's worker_routing decides alone."
        ),
    )
    feed_interval_ms: int = Field(
        default=100,
        ge=50,
        le=30_000,
        description="How often the control plane sends the workers' figures.",
    )
    slack_streams: int = Field(
        default=2,
        ge=0,
        description=(
            "A request goes to the first worker in its affinity key's ranking whose queue "
            "(running + waiting requests) is at most this many streams longer than the least-"
            "loaded serving worker's (or slack_percent of that one's, if more). 0: the least-"
            "loaded worker, the key's ranking breaking ties."
        ),
    )
    slack_percent: int = Field(
        default=25,
        ge=0,
        description="The slack as a percentage of the least-loaded worker's queue.",
    )
    work_bound_percent: int = Field(
        default=0,
        ge=0,
        description=(
            "Percent of the mean serving worker's prompt tokens, computed over "
            "work_window_seconds, above which a worker gets no slack: it takes a request only "
            "while its queue is as short as the least-loaded worker's. 0: off (the default: "
            "the bound also moves a burst of a hot prefix off the worker that just computed "
            "it; docs/decisions/0008-endpoint-picker.md)."
        ),
    )
    work_window_seconds: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="The window over which the workers' computed prompt tokens are compared.",
    )
    candidates: int = Field(
        default=3,
        ge=1,
        le=16,
        description=(
            "Workers named per request (x-tokenmesh-worker), best first: a retry before the "
            "first token goes to the next; after the last, Envoy's least request picks."
        ),
    )
    stale_seconds: float = Field(
        default=3.0,
        gt=0,
        description=(
            "With no figures from the control plane for this long, the picker names no worker "
            "(Envoy's least request decides) until they are back."
        ),
    )

    @field_validator("work_bound_percent")
    @classmethod
    def _a_bound_over_the_mean(cls, value: int) -> int:
        if 0 < value < 100:
            raise ValueError("must be 0 (off) or at least 100 (the mean)")
        return value


class GatewaySettings(ServiceSettings, SamplingLimits, ToolLimits):
    model_config = SettingsConfigDict(
        env_prefix="TOKENMESH_GATEWAY_", env_nested_delimiter="__", frozen=True, extra="ignore"
    )

    port: int = Field(default=50050, ge=0, le=65535)
    metrics_port: int = Field(default=9450, ge=-1, le=65535)
    max_message_bytes: int = Field(
        default=1 * MIB,
        ge=1024,
        description=(
            "Largest protobuf message accepted or sent: the largest valid request (a 32 KiB "
            "prompt with 32 documents of 8 KiB) is about 300 KiB; bigger ones fail "
            "RESOURCE_EXHAUSTED as soon as their length is read. Also the size of Envoy's "
            "REST/JSON body buffer."
        ),
    )

    worker_address: str = Field(
        default="127.0.0.1:50061",
        description="Where the workers are reached (an Envoy listener in the full mesh).",
    )
    worker_pools: tuple[str, ...] = Field(
        default=(),
        description=(
            "Further pools of workers beside the default pool (Envoy's worker_pools, the "
            "same names): each serves a base model of its own and its adapters. The catalog "
            "asks each pool what it serves, and a request naming one of those goes to its "
            "pool (x-tokenmesh-pool). JSON in TOKENMESH_GATEWAY_WORKER_POOLS."
        ),
    )

    @field_validator("worker_pools")
    @classmethod
    def _pool_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        return pool_names(names)

    reranker_address: str = Field(
        default="127.0.0.1:50071",
        description="Where the reranker is reached (an Envoy listener in the full mesh).",
    )
    dependency_tls_ca_file: Path | None = Field(
        default=None,
        description=(
            "TLS to those addresses (Envoy's internal listeners with internal TLS on): the "
            "PEM CA that signed their certificate, which must name the address's host. Unset:"
            " plaintext."
        ),
    )
    connect_timeout_seconds: float = Field(
        default=2.0,
        gt=0,
        description=(
            "A dependency that cannot be connected to within this long fails the call UNAVAILABLE."
        ),
    )
    affinity_prefix_chars: int = Field(
        default=1024,
        ge=1,
        le=1_000_000,
        description=(
            "How many characters from the start of a prompt make its prefix-affinity key "
            "(x-tokenmesh-affinity, which Envoy hashes with worker_routing prefix); of a "
            "conversation, its messages up to the first user message, so later turns keep "
            "the first turn's key. Prompts that agree this far go to one worker."
        ),
    )
    deadline_margin_seconds: float = Field(
        default=0.15,
        ge=0,
        description=(
            "Seconds subtracted from the caller's remaining deadline for calls to "
            "dependencies, so the gateway ends a stream with DEADLINE_EXCEEDED before the edge "
            "Envoy's timer for the same deadline fires (Envoy can only reset a stream whose "
            "response has started, which a client reports as INTERNAL; "
            "docs/decisions/0012-deadline-margin-150-ms.md)."
        ),
    )
    reranker_timeout_seconds: float = Field(
        default=1.0,
        gt=0,
        description=(
            "Longest a rerank may take even when the caller allows more; then the answer degrades."
        ),
    )
    breaker: BreakerSettings = BreakerSettings()
    picker: PickerSettings = PickerSettings()

    keys_file: Path | None = Field(
        default=None,
        description=(
            "API keys and per-tenant limits: a JSON keys file (docs/security.md; add a key "
            "with `python -m tokenmesh.gateway.keys add`). Unset: no authentication and no "
            "tenant limits (the `make up` default); set, every RPC but the open methods needs"
            " a key."
        ),
    )
    keys_reload_seconds: float = Field(
        default=1.0,
        gt=0,
        description=(
            "How often the keys file is checked for changes (mtime, size, inode); a change "
            "applies without a restart, a broken file keeps the last good keys."
        ),
    )
    open_methods: tuple[str, ...] = Field(
        default=("/grpc.health.v1.Health/", "/grpc.reflection."),
        description=(
            "Methods callable without a key: full method names or prefixes of them (JSON list)."
        ),
    )
    concurrency_retry_after_ms: int = Field(
        default=1000,
        ge=0,
        description=(
            "retry-after-ms sent with a refusal at a tenant's concurrent-stream limit (when "
            "one of its streams will end is not known; rate and quota refusals compute "
            "theirs)."
        ),
    )

    log_prompts: bool = Field(
        default=False,
        description=(
            "Log every prompt as sent to a worker (with its context documents or chat "
            "history), at INFO on logger tokenmesh.gateway.prompts, to debug prompt assembly."
            " Prompts are user data: off by default, never on in production; nothing else "
            "ever logs request text."
        ),
    )

    max_prompt_bytes: int = Field(
        default=32 * 1024,
        ge=1,
        description=(
            "Request limit (past it: INVALID_ARGUMENT naming the limit): `prompt` (Generate, "
            "GetAnswer) 1..this many bytes; Summarize's `instruction` 0..this many."
        ),
    )
    max_documents: int = Field(
        default=32, ge=0, description="Request limit: `documents` at most this many."
    )
    max_document_bytes: int = Field(
        default=8 * 1024, ge=1, description="Request limit: each of `documents` 1..this many bytes."
    )
    max_top_k_documents: int = Field(
        default=8,
        ge=1,
        description="Request limit: `top_k_documents` 0..this (0: default_top_k_documents).",
    )
    default_top_k_documents: int = Field(
        default=3, ge=1, description="Documents used as context when a request does not say."
    )
    max_message_tokens: int = Field(
        default=64,
        ge=1,
        description=(
            "Tokens that arrive from the worker while a message to the client is still being "
            "written go out together, at most this many a message (one worker message is "
            "never split)."
        ),
    )
    max_coalesced_tokens: int = Field(
        default=256,
        ge=1,
        description=(
            "Past this many tokens waiting for a write still in progress the gateway stops "
            "reading, and HTTP/2 flow control holds the rest back at the worker (a stalled "
            "client)."
        ),
    )
    max_resumptions: int = Field(
        default=2,
        ge=0,
        le=16,
        description=(
            "A stream whose worker goes away mid-stream (killed, its connection cut, its engine "
            "dead) continues on another worker from the token where it stopped, at most this "
            "many times a stream and within its deadline; 0: never (the stream ends with the "
            "worker's error)."
        ),
    )
    max_summarize_bytes: int = Field(
        default=64 * 1024, ge=1, description="Summarize: the whole text sent in chunks, in bytes."
    )
    max_summarize_chunks: int = Field(default=4096, ge=1, description="Summarize: chunks per call.")
    summarize_instruction: str = Field(
        default="Summarize the following text.",
        description="Summarize: the instruction used when the first chunk sets none.",
    )
    max_chat_turns: int = Field(
        default=16,
        ge=1,
        description=(
            "Chat: turns of history kept per stream, oldest dropped first past this or "
            "max_chat_history_tokens."
        ),
    )
    max_chat_history_tokens: int = Field(
        default=1024,
        ge=1,
        description=(
            "Chat: history tokens kept per stream, oldest turns dropped first past this or "
            "max_chat_turns."
        ),
    )
    max_chat_message_bytes: int = Field(
        default=8 * 1024,
        ge=1,
        description="Request limit: Chat's `user.content` 1..this many bytes.",
    )
    max_chat_messages: int = Field(
        default=64,
        ge=1,
        description=(
            "Request limit: `messages` of an OpenAI chat completion at most this many, each "
            "message's content at most max_chat_message_bytes."
        ),
    )
    openai_port: int = Field(
        default=8090,
        ge=-1,
        le=65535,
        description=(
            "The OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions, "
            "/v1/embeddings, /v1/rerank; Envoy's edge routes /v1/ here); 0 picks a free port, "
            "-1 turns it off."
        ),
    )
    http_request_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        description=(
            "OpenAI API: how long a request may take (HTTP has no grpc-timeout; the OpenAI "
            "SDKs' own default), the deadline the worker call (the reranker call for "
            "/v1/embeddings and /v1/rerank) gets."
        ),
    )
    max_chat_pending_turns: int = Field(
        default=8,
        ge=0,
        description=(
            "User turns a Chat stream may send ahead of the one being answered (they wait "
            "their turn); one more ends the stream with RESOURCE_EXHAUSTED, so a client "
            "cannot pile up work in a gateway's memory."
        ),
    )
