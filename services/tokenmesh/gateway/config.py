"""Gateway settings, from TOKENMESH_GATEWAY_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field
from pydantic_settings import SettingsConfigDict

from tokenmesh.common.settings import MIB, ServiceSettings


class BreakerSettings(BaseModel):
    """When the reranker's circuit opens, and how it recovers."""

    model_config = {"frozen": True}

    # Consecutive failed calls that open the circuit.
    consecutive_failures: int = Field(default=5, ge=1)
    # Or: this fraction of failed calls within the rolling window ...
    failure_rate: float = Field(default=0.5, gt=0, le=1)
    # ... once the window holds at least this many calls (so 1 failure of 1 does not trip it).
    min_calls_in_window: int = Field(default=10, ge=1)
    window_seconds: float = Field(default=10.0, gt=0)
    # How long an open circuit refuses calls (no network wait) before letting probes through.
    open_seconds: float = Field(default=5.0, gt=0)
    # Probe calls let through at once while half-open; their success closes the circuit.
    half_open_max_calls: int = Field(default=1, ge=1)


class GatewaySettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="TOKENMESH_GATEWAY_", env_nested_delimiter="__", frozen=True, extra="ignore"
    )

    port: int = Field(default=50050, ge=0, le=65535)
    metrics_port: int = Field(default=9450, ge=-1, le=65535)
    # Largest protobuf message accepted or sent: the largest valid request (a 32 KiB prompt
    # with 32 documents of 8 KiB) is about 300 KiB; bigger ones fail RESOURCE_EXHAUSTED as
    # soon as their length is read. Also the size of Envoy's REST/JSON body buffer.
    max_message_bytes: int = Field(default=1 * MIB, ge=1024)

    # Where the workers and the reranker are reached (an Envoy listener in the full mesh).
    worker_address: str = "127.0.0.1:50061"
    reranker_address: str = "127.0.0.1:50071"
    # TLS to those addresses (Envoy's internal listeners with internal TLS on): the PEM CA that
    # signed their certificate, which must name the address's host. Unset: plaintext.
    dependency_tls_ca_file: Path | None = None
    # A dependency that cannot be connected to within this long fails the call UNAVAILABLE.
    connect_timeout_seconds: float = Field(default=2.0, gt=0)
    # Subtracted from the caller's remaining deadline for calls to dependencies, so the gateway
    # ends a stream with DEADLINE_EXCEEDED itself before the edge Envoy's timer for the same
    # deadline fires: Envoy can only reset a stream whose response has started, which a client
    # slow to see its own deadline reports as INTERNAL. Measured in a deadline storm on two busy
    # cores: 50 ms left 7% of streams to Envoy's timer (some after their first token), 150 ms
    # left 3% (all before it, answered DEADLINE_EXCEEDED).
    deadline_margin_seconds: float = Field(default=0.15, ge=0)
    # Longest a rerank may take even when the caller allows more; then the answer degrades.
    reranker_timeout_seconds: float = Field(default=1.0, gt=0)
    breaker: BreakerSettings = BreakerSettings()

    # API keys and per-tenant limits: a JSON keys file (README "Security"; add a key with
    # `python -m tokenmesh.gateway.keys add`). Unset: no authentication and no tenant limits
    # (the `make up` default); set, every RPC but the open methods needs a key.
    keys_file: Path | None = None
    # How often the keys file is checked for changes (mtime, size, inode); a change applies
    # without a restart, a broken file keeps the last good keys.
    keys_reload_seconds: float = Field(default=1.0, gt=0)
    # Methods callable without a key: full method names or prefixes of them (JSON list).
    open_methods: tuple[str, ...] = ("/grpc.health.v1.Health/", "/grpc.reflection.")
    # retry-after-ms sent with a refusal at a tenant's concurrent-stream limit (when one of
    # its streams will end is not known; rate and quota refusals compute theirs).
    concurrency_retry_after_ms: int = Field(default=1000, ge=0)

    # Log every prompt as sent to a worker (with its context documents or chat history), at
    # INFO on logger tokenmesh.gateway.prompts, to debug prompt assembly. Prompts are user data:
    # off by default, never on in production; nothing else ever logs request text.
    log_prompts: bool = False

    # Request limits; anything past them is rejected with INVALID_ARGUMENT naming the limit.
    max_prompt_bytes: int = Field(default=32 * 1024, ge=1)
    max_tokens_cap: int = Field(default=4096, ge=1)
    max_documents: int = Field(default=32, ge=0)
    max_document_bytes: int = Field(default=8 * 1024, ge=1)
    max_top_k_documents: int = Field(default=8, ge=1)
    # Documents used as context when a request does not say.
    default_top_k_documents: int = Field(default=3, ge=1)
    max_stop_sequences: int = Field(default=8, ge=0)
    # Each stop string: 1 byte .. this (UTF-8); the workers' own limit is the same.
    max_stop_sequence_bytes: int = Field(default=256, ge=1)
    # Alternatives per token a request may ask for (top_logprobs); at most the workers' cap.
    max_top_logprobs: int = Field(default=20, ge=0)
    # Tokens per message a request may ask for (stream_interval); at most the workers' cap.
    max_stream_interval: int = Field(default=64, ge=1)
    # Tokens that arrive from the worker while a message to the client is still being written
    # go out together, at most max_message_tokens a message (one worker message is never
    # split); past max_coalesced_tokens waiting the gateway stops reading, and HTTP/2 flow
    # control holds the rest back at the worker (a stalled client).
    max_message_tokens: int = Field(default=64, ge=1)
    max_coalesced_tokens: int = Field(default=256, ge=1)
    # Summarize: the whole text sent in chunks, and how many chunks.
    max_summarize_bytes: int = Field(default=64 * 1024, ge=1)
    max_summarize_chunks: int = Field(default=4096, ge=1)
    summarize_instruction: str = "Summarize the following text."
    # Chat: history kept per stream, oldest turns dropped first past either bound.
    max_chat_turns: int = Field(default=16, ge=1)
    max_chat_history_tokens: int = Field(default=1024, ge=1)
    max_chat_message_bytes: int = Field(default=8 * 1024, ge=1)
    # User turns a Chat stream may send ahead of the one being answered (they wait their
    # turn); one more ends the stream with RESOURCE_EXHAUSTED, so a client cannot pile up
    # work in a gateway's memory.
    max_chat_pending_turns: int = Field(default=8, ge=0)
