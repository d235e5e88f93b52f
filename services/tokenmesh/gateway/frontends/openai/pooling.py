"""OpenAI's /v1/embeddings and vLLM's /v1/rerank: the requests, the reranker's EmbeddingService
calls they become, and the answers, on the gateway's HTTP API (docs/openai.md; why here and not
a transcoded method on the reranker: docs/decisions/0022-embeddings-and-rerank-at-the-edge.md).

The request and answer shapes are those of vLLM's server (vllm/entrypoints/pooling/embed/
protocol.py: EmbeddingCompletionRequest, EmbeddingResponse; scoring/protocol.py: RerankRequest,
RerankResponse), copied rather than imported: the gateway never imports vLLM. Only their text
fields are taken; everything else a client sends is refused by name, never ignored."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal, TypeVar

import grpc
import numpy as np
from grpc import aio
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.types import Send

from tokenmesh.common.channels import Dependency
from tokenmesh.common.errors import InvalidArgument
from tokenmesh.gateway.core.catalog import ModelNotFound
from tokenmesh.gateway.core.tenancy.http import HttpTenancy
from tokenmesh.gateway.frontends.openai.http import (
    Answer,
    Outcome,
    request_headers,
    send_error,
    send_json,
)
from tokenmesh.v1 import rerank_pb2, rerank_pb2_grpc

# How long the embedding model's description is trusted before the reranker is asked again.
DESCRIPTION_TTL_SECONDS = 30.0
# What the protobuf int32 fields these numbers go into hold.
Int32Max = 2**31 - 1


def texts(value: Any) -> Any:
    """`input` as a list of texts: a string is one. Token ids (a list of ints, or of lists)
    are refused by name: the reranker's model reads text."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of strings")
    if any(
        isinstance(item, list) or (isinstance(item, int) and not isinstance(item, bool))
        for item in value
    ):
        raise ValueError("token ids are not supported: send a string or a list of strings")
    return value


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI's; vLLM's EmbeddingCompletionRequest with text input)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: Annotated[list[str], BeforeValidator(texts)]
    encoding_format: Literal["float", "base64"] = "float"
    # Only the model's own length (the reranker refuses any other).
    dimensions: int | None = Field(default=None, ge=1, le=Int32Max)
    # Accepted as OpenAI's API accepts it; changes nothing.
    user: str | None = None


class RerankRequest(BaseModel):
    """POST /v1/rerank (vLLM's RerankRequest with text documents)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    query: str
    documents: list[str]
    # 0 (the default), or more than there are documents: all of them.
    top_n: int = Field(default=0, ge=0, le=Int32Max)
    user: str | None = None


Body = TypeVar("Body", bound=BaseModel)


def field_name(location: tuple[int | str, ...]) -> str:
    """A pydantic error's location as the API names fields: input[2], documents[0]."""
    name = ""
    for part in location:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else part)
    return name or "body"


def parse(model: type[Body], body: bytes) -> Body:
    """The request body as `model`, or InvalidArgument naming the field: every unknown field
    at once, else the first bad one."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors()
        unknown = [field_name(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
        if unknown:
            known = ", ".join(model.model_fields)
            raise InvalidArgument(
                ", ".join(unknown), f"not supported (this endpoint takes {known})"
            ) from exc
        error = errors[0]
        if error["type"] == "json_invalid":
            raise InvalidArgument("body", "not valid JSON") from exc
        if error["type"] == "model_type":
            raise InvalidArgument("body", "must be a JSON object") from exc
        message = error["msg"].removeprefix("Value error, ")
        raise InvalidArgument(field_name(error["loc"]), message) from exc


def embedding_answer(request: EmbeddingRequest, reply: rerank_pb2.EmbedResponse) -> dict[str, Any]:
    """OpenAI's embeddings list; base64 is the float32 values, little-endian, as OpenAI's
    (and its SDKs', which ask for it by default) decode it."""
    data = []
    for index, embedding in enumerate(reply.data):
        value: list[float] | str
        if request.encoding_format == "base64":
            raw = np.asarray(embedding.values, dtype="<f4").tobytes()
            value = base64.b64encode(raw).decode()
        else:
            value = list(embedding.values)
        data.append({"object": "embedding", "index": index, "embedding": value})
    usage = {"prompt_tokens": reply.prompt_tokens, "total_tokens": reply.prompt_tokens}
    return {"object": "list", "data": data, "model": reply.model, "usage": usage}


def rerank_answer(request: RerankRequest, reply: rerank_pb2.RankResponse) -> dict[str, Any]:
    """vLLM's rerank answer: the results best first, each with its document's text."""
    results = [
        {
            "index": result.index,
            "document": {"text": request.documents[result.index]},
            "relevance_score": result.score,
        }
        for result in reply.results
    ]
    usage = {"prompt_tokens": reply.total_tokens, "total_tokens": reply.total_tokens}
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": reply.model,
        "usage": usage,
        "results": results,
    }


class EmbeddingClient:
    """The reranker's EmbeddingService (through Envoy in the mesh): its refusals as the
    caller's errors naming the field, its description cached for /v1/models."""

    def __init__(self, reranker: Dependency, timeout: float, describe_timeout: float) -> None:
        self._reranker = reranker
        self._stub = rerank_pb2_grpc.EmbeddingServiceStub(reranker.channel)
        self._timeout = timeout
        self._describe_timeout = describe_timeout
        self._description: rerank_pb2.ModelDescription | None = None
        self._asked = 0.0

    async def embed(self, request: EmbeddingRequest) -> rerank_pb2.EmbedResponse:
        call = rerank_pb2.EmbedRequest(
            model=request.model, input=request.input, dimensions=request.dimensions or 0
        )
        reply: rerank_pb2.EmbedResponse = await self._call(self._stub.Embed, call)
        return reply

    async def rank(self, request: RerankRequest) -> rerank_pb2.RankResponse:
        call = rerank_pb2.RankRequest(
            model=request.model,
            query=request.query,
            documents=request.documents,
            top_n=request.top_n,
        )
        reply: rerank_pb2.RankResponse = await self._call(self._stub.Rank, call)
        return reply

    async def describe(self) -> rerank_pb2.ModelDescription | None:
        """The served model's description; the last one known while the reranker does not
        answer, None if it never has."""
        if self._description is None or time.monotonic() - self._asked > DESCRIPTION_TTL_SECONDS:
            try:
                self._description = await self._stub.Describe(
                    rerank_pb2.DescribeRequest(), timeout=self._describe_timeout
                )
                self._asked = time.monotonic()
            except aio.AioRpcError:
                pass
        return self._description

    async def _call(self, method: Callable[..., Awaitable[Any]], request: Any) -> Any:
        return await unary_call(self._reranker, method, request, self._timeout)


async def unary_call(
    dependency: Dependency,
    method: Callable[..., Awaitable[Any]],
    request: Any,
    seconds: float,
    metadata: tuple[tuple[str, str], ...] = (),
) -> Any:
    """One call to a service of the mesh (metadata: its routing): its refusals as the caller's
    errors naming the field (INVALID_ARGUMENT "field: reason") or the model (NOT_FOUND),
    anything else as the dependency's failure."""
    try:
        return await method(request, timeout=seconds, metadata=metadata)
    except aio.AioRpcError as err:
        details = err.details() or ""
        if err.code() is grpc.StatusCode.INVALID_ARGUMENT and ": " in details:
            field, reason = details.split(": ", 1)
            raise InvalidArgument(field, reason) from err
        if err.code() is grpc.StatusCode.NOT_FOUND:
            raise ModelNotFound(details) from err
        raise dependency.error(err) from err


class PoolingApi:
    """The two routes' handlers: authenticate and admit as every OpenAI route does, parse,
    call the reranker (a client that goes away cancels the call), answer."""

    def __init__(self, client: EmbeddingClient, tenancy: HttpTenancy) -> None:
        self._client = client
        self._tenancy = tenancy

    def routes(self) -> list[tuple[str, Callable[[Request, Outcome], Awaitable[Answer]]]]:
        return [("/v1/embeddings", self.embeddings), ("/v1/rerank", self.rerank)]

    async def embeddings(self, request: Request, outcome: Outcome) -> Answer:
        return await self._unary(request, outcome, EmbeddingRequest, self._embed)

    async def rerank(self, request: Request, outcome: Outcome) -> Answer:
        return await self._unary(request, outcome, RerankRequest, self._rank)

    async def model_card(self) -> dict[str, Any] | None:
        """The embedding model as /v1/models lists it; None while the reranker has never
        described it (the served LLM is listed regardless)."""
        described = await self._client.describe()
        if described is None:
            return None
        return {
            "id": described.model,
            "object": "model",
            "created": 0,
            "owned_by": "tokenmesh",
            "max_model_len": described.max_input_tokens,
        }

    async def _embed(self, body: EmbeddingRequest) -> dict[str, Any]:
        return embedding_answer(body, await self._client.embed(body))

    async def _rank(self, body: RerankRequest) -> dict[str, Any]:
        return rerank_answer(body, await self._client.rank(body))

    async def _unary(
        self,
        request: Request,
        outcome: Outcome,
        model: type[Body],
        answer: Callable[[Body], Awaitable[dict[str, Any]]],
    ) -> Answer:
        return await unary_answer(request, outcome, self._tenancy, model, answer)


async def unary_answer(
    request: Request,
    outcome: Outcome,
    tenancy: HttpTenancy,
    model: type[Body],
    answer: Callable[[Body], Awaitable[dict[str, Any]]],
) -> Answer:
    """One JSON answer to one JSON request, admitted as every OpenAI route admits (its key and
    tenant limits), the body parsed as `model` (parse), errors as OpenAI's error object; a
    client that goes away cancels the work."""
    release = await tenancy.admit(request_headers(request))
    try:
        body = parse(model, await request.body())
    except BaseException:
        if release is not None:
            release()
        raise

    async def work(send: Send) -> None:
        try:
            answered = await answer(body)
        except Exception as exc:
            await send_error(send, outcome, exc)
        else:
            await send_json(send, 200, answered)
        finally:
            if release is not None:
                release()

    return Answer(work, outcome)
