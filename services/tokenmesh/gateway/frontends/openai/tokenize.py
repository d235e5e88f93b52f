"""vLLM's /tokenize and /detokenize: a prompt's (or a chat's) tokens as the model sees them, and
the text of tokens, answered by a worker's tokenizer (InferenceService.Tokenize, Detokenize).

The request and answer shapes are those of vLLM's server (vllm/entrypoints/serve/tokenize/
protocol.py: TokenizeCompletionRequest, TokenizeChatRequest, TokenizeResponse,
DetokenizeRequest, DetokenizeResponse), copied rather than imported: the gateway never imports
vLLM. Fields of theirs that change a template (chat_template, chat_template_kwargs,
continue_final_message, mm_processor_kwargs) are refused by name, never ignored."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request

from tokenmesh.common.channels import Dependency
from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.sampling import ToolLimits, check_tools
from tokenmesh.common.tenants import tenant_models
from tokenmesh.gateway.core.catalog import ModelCatalog, Served
from tokenmesh.gateway.core.tenancy.http import HttpTenancy
from tokenmesh.gateway.frontends.openai.http import Answer, Outcome
from tokenmesh.gateway.frontends.openai.pooling import unary_answer, unary_call
from tokenmesh.gateway.frontends.openai.protocol import ChatCompletionRequest, Message
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc


class TokenizeRequest(BaseModel):
    """POST /tokenize: vLLM's TokenizeCompletionRequest (prompt) or TokenizeChatRequest
    (messages, tools, add_generation_prompt), one model for both as vLLM's route takes
    either."""

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool = False

    def call(self, limits: ToolLimits) -> inference_pb2.TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidArgument("prompt", "send a prompt or messages (one of them)")
        call = inference_pb2.TokenizeRequest(
            prompt=self.prompt or "", return_token_strs=self.return_token_strs
        )
        if self.messages is not None:
            chat = ChatCompletionRequest(model=self.model, messages=self.messages)
            call.messages.extend(chat.conversation(None))
            if self.tools:
                call.tools.tools_json = json.dumps(self.tools)
                check_tools("tools", call.tools, limits)
        elif self.tools is not None or self.add_generation_prompt is not None:
            field = "tools" if self.tools is not None else "add_generation_prompt"
            raise InvalidArgument(field, "only with messages")
        if self.add_special_tokens is not None:
            call.add_special_tokens = self.add_special_tokens
        if self.add_generation_prompt is not None:
            call.add_generation_prompt = self.add_generation_prompt
        return call


class DetokenizeRequest(BaseModel):
    """POST /detokenize: vLLM's DetokenizeRequest."""

    model_config = ConfigDict(extra="forbid")

    model: str
    tokens: list[int]


class TokenizeApi:
    """The two routes: admitted and parsed as every OpenAI route, the model checked, a worker's
    tokenizer asked (through the mesh, any worker of the pool that serves the model)."""

    def __init__(
        self,
        worker: Dependency,
        catalog: ModelCatalog,
        tenancy: HttpTenancy,
        limits: ToolLimits,
        timeout: float,
    ) -> None:
        self._worker = worker
        self._stub = inference_pb2_grpc.InferenceServiceStub(worker.channel)
        self._catalog = catalog
        self._tenancy = tenancy
        self._limits = limits
        self._timeout = timeout

    def routes(self) -> list[tuple[str, Callable[[Request, Outcome], Awaitable[Answer]]]]:
        return [("/tokenize", self.tokenize), ("/detokenize", self.detokenize)]

    async def tokenize(self, request: Request, outcome: Outcome) -> Answer:
        return await unary_answer(request, outcome, self._tenancy, TokenizeRequest, self._tokens)

    async def detokenize(self, request: Request, outcome: Outcome) -> Answer:
        return await unary_answer(request, outcome, self._tenancy, DetokenizeRequest, self._text)

    async def _tokens(self, body: TokenizeRequest) -> dict[str, Any]:
        served = await self._catalog.resolve(body.model, tenant_models())
        reply = await self._call(self._stub.Tokenize, body.call(self._limits), served)
        answer: dict[str, Any] = {
            "count": len(reply.tokens),
            "max_model_len": reply.max_model_len,
            "tokens": list(reply.tokens),
            "token_strs": list(reply.token_strs) if body.return_token_strs else None,
        }
        return answer

    async def _text(self, body: DetokenizeRequest) -> dict[str, Any]:
        served = await self._catalog.resolve(body.model, tenant_models())
        for position, token in enumerate(body.tokens):
            if not 0 <= token < 2**31:
                raise InvalidArgument(
                    f"tokens[{position}]", f"must be a vocabulary id, got {token}"
                )
        reply = await self._call(
            self._stub.Detokenize, inference_pb2.DetokenizeRequest(tokens=body.tokens), served
        )
        return {"prompt": reply.prompt}

    async def _call(
        self, method: Callable[..., Awaitable[Any]], request: Any, served: Served
    ) -> Any:
        return await unary_call(self._worker, method, request, self._timeout, served.metadata())
