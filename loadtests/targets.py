"""The services the load generator can drive, each behind one interface: open a connection,
stream one request's tokens. Every target is on 127.0.0.1.

worker    tokenmesh.v1.InferenceService/Generate (a worker, or Envoy's worker listener)
llm       tokenmesh.v1.LLMService/Generate over gRPC (a gateway, or the Envoy edge)
rest      the same through Envoy's gRPC-JSON transcoder: POST, one JSON object per line
openai    an OpenAI-compatible server (vLLM's own): POST /v1/completions, stream=true (SSE)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, Self

import aiohttp
import grpc
from grpc import aio

from loadtests.workload import RequestSpec
from tokenmesh.common.tokens import token_count

KINDS = ("worker", "llm", "rest", "openai")
# Documents the gateway reranks when a workload asks for context.
DOCUMENTS = [f"Passage {i} about topic {i % 5}: some words for the reranker." for i in range(16)]
# One channel carries every stream of a process (HTTP/2 multiplexing), as one client would;
# raise the per-connection stream cap the client honours to what Envoy and gRPC servers allow.
CHANNEL_OPTIONS = [("grpc.max_concurrent_streams", 10_000)]


@dataclass(frozen=True)
class Message:
    """One streamed message: how many tokens it carried, and the first warning, if any."""

    tokens: int
    warning: str = ""
    # False: a bookkeeping message (a final usage count), not a token arrival to time.
    arrival: bool = True
    # When the worker emitted the token (Token.emitted_unix_nanos), 0 when unknown.
    emitted_ns: int = 0


class RequestFailed(Exception):
    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


class Target(Protocol):
    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    def stream(self, spec: RequestSpec, limit: float) -> AsyncIterator[Message]: ...


def check_local(address: str) -> None:
    host = address.rsplit(":", 1)[0]
    if host not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"the load generator only targets 127.0.0.1, not {address}")


def status_of(error: BaseException) -> str:
    """The status code name a failed request is counted under."""
    if isinstance(error, RequestFailed):
        return error.status
    if isinstance(error, grpc.RpcError):
        return str(error.code().name)
    if isinstance(error, TimeoutError):
        return "CLIENT_TIMEOUT"
    return type(error).__name__


class _Grpc:
    def __init__(self, address: str, documents: int = 0, connections: int = 1) -> None:
        check_local(address)
        self.address = address
        self.documents = DOCUMENTS[:documents]
        self._connections = connections
        self._channels: list[aio.Channel] = []
        self._next = 0

    async def __aenter__(self) -> Self:
        # A connection of its own per channel (grpc shares one between alike channels).
        options = CHANNEL_OPTIONS + (
            [("grpc.use_local_subchannel_pool", 1)] if self._connections > 1 else []
        )
        self._channels = [
            aio.insecure_channel(self.address, options=options) for _ in range(self._connections)
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for channel in self._channels:
            await channel.close()

    @property
    def channel(self) -> aio.Channel:
        """The next connection, in turn."""
        assert self._channels, "use the target as an async context manager"
        self._next = (self._next + 1) % len(self._channels)
        return self._channels[self._next]


class WorkerTarget(_Grpc):
    async def stream(self, spec: RequestSpec, limit: float) -> AsyncIterator[Message]:
        from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

        request = inference_pb2.InferenceRequest(
            prompt=spec.prompt,
            sampling=inference_pb2.SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True),
        )
        stub = inference_pb2_grpc.InferenceServiceStub(self.channel)
        async for token in stub.Generate(request, timeout=limit):
            yield Message(token_count(token), emitted_ns=token.emitted_unix_nanos)


class LLMTarget(_Grpc):
    def __init__(
        self, address: str, documents: int = 0, stream_interval: int = 0, connections: int = 1
    ) -> None:
        super().__init__(address, documents, connections)
        self.stream_interval = stream_interval

    async def stream(self, spec: RequestSpec, limit: float) -> AsyncIterator[Message]:
        from tokenmesh.v1 import llm_pb2, llm_pb2_grpc

        request = llm_pb2.GenerateRequest(
            prompt=spec.prompt,
            max_tokens=spec.max_tokens,
            ignore_eos=True,
            stream_interval=self.stream_interval,
            documents=self.documents,
            top_k_documents=2 if self.documents else 0,
        )
        stub = llm_pb2_grpc.LLMServiceStub(self.channel)
        # The caller's own request id finds the stream's lines in Envoy's access log.
        metadata = (("x-request-id", spec.request_id),) if spec.request_id else None
        async for token in stub.Generate(request, timeout=limit, metadata=metadata):
            warning = token.warnings[0] if token.warnings else ""
            yield Message(token_count(token), warning, emitted_ns=token.emitted_unix_nanos)


class _Http:
    def __init__(self, address: str, documents: int = 0, model: str = "") -> None:
        check_local(address)
        self.base = f"http://{address}"
        self.documents = DOCUMENTS[:documents]
        self.model = model
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        # HTTP/1.1 keeps one connection per concurrent request (no multiplexing).
        connector = aiohttp.TCPConnector(limit=0)
        self._session = aiohttp.ClientSession(connector=connector)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "use the target as an async context manager"
        return self._session

    async def _lines(self, path: str, body: dict[str, Any], limit: float) -> AsyncIterator[bytes]:
        total = aiohttp.ClientTimeout(total=limit)
        async with self.session.post(self.base + path, json=body, timeout=total) as reply:
            if reply.status != 200:
                raise RequestFailed(f"HTTP_{reply.status}")
            async for line in reply.content:
                line = line.strip()
                if line:
                    yield line


class RestTarget(_Http):
    """Envoy's transcoder writes each Token as one JSON object per line, as it comes."""

    async def stream(self, spec: RequestSpec, limit: float) -> AsyncIterator[Message]:
        body: dict[str, Any] = {
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "ignore_eos": True,
        }
        if self.documents:
            body |= {"documents": self.documents, "top_k_documents": 2}
        async for line in self._lines("/tokenmesh.v1.LLMService/Generate", body, limit):
            token = json.loads(line)
            if "code" in token and "text" not in token and "index" not in token:
                raise RequestFailed(f"GRPC_{token['code']}")
            warnings = token.get("warnings") or [""]
            # JSON leaves out default values: a token id of 0 is not written, nor an empty list.
            ids = token.get("token_ids")
            count = len(ids) if ids else int(int(token.get("token_id", 0)) >= 0)
            emitted = int(token.get("emitted_unix_nanos") or 0)
            yield Message(count, warnings[0], emitted_ns=emitted)


class OpenAITarget(_Http):
    """vLLM's OpenAI-compatible server: one SSE event per engine output (one token, or
    several when the server fell behind the engine), the usage in a last event
    (stream_options.include_usage), which makes the token count exact."""

    def __init__(
        self, address: str, documents: int = 0, model: str = "", structured_json: str = ""
    ) -> None:
        super().__init__(address, documents, model)
        # Every answer follows this JSON schema (vLLM's structured_outputs), when given.
        self.schema = json.loads(structured_json) if structured_json else None

    async def stream(self, spec: RequestSpec, limit: float) -> AsyncIterator[Message]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.schema is not None:
            body["structured_outputs"] = {"json": self.schema}
        events = 0
        async for line in self._lines("/v1/completions", body, limit):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            event = json.loads(data)
            if event.get("choices"):
                events += 1
                yield Message(1)
            elif event.get("usage"):
                extra = int(event["usage"]["completion_tokens"]) - events
                if extra > 0:
                    yield Message(extra, arrival=False)


def make_target(
    kind: str,
    address: str,
    documents: int = 0,
    model: str = "",
    stream_interval: int = 0,
    structured_json: str = "",
    connections: int = 1,
) -> Target:
    if kind == "worker":
        return WorkerTarget(address, connections=connections)
    if kind == "llm":
        return LLMTarget(address, documents, stream_interval, connections)
    if kind == "rest":
        return RestTarget(address, documents)
    if kind == "openai":
        return OpenAITarget(address, documents, model, structured_json)
    raise ValueError(f"unknown target kind {kind!r}: one of {', '.join(KINDS)}")
