"""InferenceService RPC handlers: validate, stream the engine's tokens, abort on cancel."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from google.api import httpbody_pb2
from grpc import aio
from prometheus_client import Counter

from tokenmesh.common.errors import DeadlineExceeded, InvalidArgument, ServiceError
from tokenmesh.common.metrics import StreamMetrics
from tokenmesh.common.outcome import Deadline
from tokenmesh.common.presentation import OpenAIPresenter, stream_trailers
from tokenmesh.common.resumption import Delivered, read_delivered
from tokenmesh.common.tokens import USAGE_TRAILER, ends_stream, usage_trailer
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2
from tokenmesh.worker.admission import Admission
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine import EngineSlot, VllmEngine
from tokenmesh.worker.handover import Handover
from tokenmesh.worker.outputs import Candidate, PromptPart, Tokens
from tokenmesh.worker.requests import (
    EngineRequest,
    check_token_ids,
    validate,
    validate_tokenize,
)
from tokenmesh.worker.sampling import features


def late(limit: float) -> DeadlineExceeded:
    return DeadlineExceeded(f"deadline exceeded: the answer's time limit of {limit:g} s passed")


def token_message(tokens: Tokens) -> token_pb2.Token:
    """One Token message for consecutive tokens of a stream (token.proto says how)."""
    ids = tokens.token_ids
    token = token_pb2.Token(
        text=tokens.text,
        index=tokens.index,
        token_id=ids[0] if ids else -1,
        token_ids=ids,
        finish_reason=tokens.finish_reason,  # type: ignore[arg-type]
        emitted_unix_nanos=time.time_ns(),
    )
    if len(ids) > 1:
        token.text_lengths.extend(tokens.lengths())
    if tokens.logprobs:
        (logprob, top), *following = tokens.logprobs
        if logprob is not None:
            token.logprob = logprob
        add_candidates(token.top_logprobs, top)
        for logprob, top in following:
            position = token.following_logprobs.add()
            if logprob is not None:
                position.logprob = logprob
            add_candidates(position.top_logprobs, top)
    if tokens.choice:
        token.choice = tokens.choice
    if tokens.reasoning:
        token.reasoning = tokens.reasoning
    for piece in tokens.tool_calls:
        token.tool_calls.add(
            index=piece.index, id=piece.id, name=piece.name, arguments=piece.arguments
        )
    if tokens.prompt is not None:
        add_prompt(token.prompt, tokens.prompt)
    if tokens.last:
        token.usage.prompt_tokens = tokens.prompt_tokens
        token.usage.completion_tokens = tokens.completion_tokens
    return token


def add_prompt(field: token_pb2.PromptTokens, prompt: PromptPart) -> None:
    field.text = prompt.text
    field.token_ids.extend(prompt.token_ids)
    field.token_texts.extend(prompt.token_texts)
    for logprob, rank, top in prompt.logprobs:
        position = field.logprobs.add()
        if logprob is not None:
            position.logprob = logprob
        if rank is not None:
            position.rank = rank
        add_candidates(position.top_logprobs, top)


def add_candidates(field: Any, top: tuple[Candidate, ...]) -> None:
    """Each candidate into a repeated TokenLogprob field, built in place (no copies)."""
    for candidate in top:
        field.add(token_id=candidate.token_id, text=candidate.text, logprob=candidate.logprob)


class Trailers:
    """A token stream's trailers as its messages go out (common/presentation.py's rule): the
    degraded marker from the start, how many times it moved once it has, and with its last
    message the usage."""

    def __init__(
        self, request: inference_pb2.InferenceRequest, context: aio.ServicerContext[Any, Any]
    ) -> None:
        self._request = request
        self._context = context
        self._trailers = stream_trailers(request)
        self._messages = 0
        if self._trailers:
            context.set_trailing_metadata(self._trailers)

    def sent(self, token: token_pb2.Token) -> None:
        self._messages += 1
        if token.resumed:
            # Handed over to another worker (its engine died): the trailers say so.
            self._trailers = stream_trailers(self._request, token.resumed)
            self._context.set_trailing_metadata(self._trailers)
        if ends_stream(token):
            usage = token.usage
            value = usage_trailer(usage.prompt_tokens, usage.completion_tokens, self._messages)
            self._context.set_trailing_metadata((*self._trailers, (USAGE_TRAILER, value)))


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(
        self,
        engines: EngineSlot,
        settings: WorkerSettings,
        stream_metrics: StreamMetrics,
        aborted: Counter,
        features: Counter,
        admission: Admission | None = None,
        handover: Handover | None = None,
    ) -> None:
        self._engines = engines
        self._settings = settings
        self._stream_metrics = stream_metrics
        # Engine requests aborted because their caller went away, by reason.
        self._aborted = aborted
        # Requests by the engine feature they use (structured outputs' kinds).
        self._features = features
        # admission: one shared by every front end over the engine (frontends.py).
        self._admission = admission or Admission(settings.max_waiting_requests)
        # Open streams, and where they go when the engine dies (nowhere without an address).
        self._handover = handover or Handover(None)

    async def Generate(
        self,
        request: inference_pb2.InferenceRequest,
        context: aio.ServicerContext[Any, Any],
    ) -> AsyncGenerator[token_pb2.Token, None]:
        # A stream the edge's byte-level relay moved here: its delivered messages as `resume`.
        request = read_delivered(request)
        spec = validate(request, self._settings)
        for feature in features(spec.options) + spec.prompt_features:
            self._features.labels(feature=feature).inc()
        trailers = Trailers(request, context)
        engine = self._engines.get()
        with self._handover.open_stream():
            deadline = Deadline.of(context)
            # What the caller has had, for a handover if the engine dies under the stream.
            delivered = Delivered.of(request)
            last: token_pb2.Token | None = None
            try:
                # Closing the inner stream (the caller went away) aborts the engine request.
                with self._admission.admit(engine.load.waiting, engine.max_num_seqs):
                    # An OpenAI answer's own time limit (GenerateOpenAI's; 0 for others).
                    time_limit = request.openai.time_limit_seconds
                    generated = self._generate(engine, spec, context, time_limit)
                    async with contextlib.aclosing(generated) as tokens:
                        async for token in tokens:
                            delivered.add(token)
                            last = token
                            trailers.sent(token)
                            yield token
                return
            except ServiceError as error:
                if not engine.errored or not self._handover.takes(delivered):
                    raise
                failure = error
            # The engine died: the rest from another worker (handover.py).
            sent_at = last.emitted_unix_nanos if last is not None else time.time_ns()
            handed = self._handover.stream(request, delivered, deadline, context, failure, sent_at)
            async with contextlib.aclosing(handed) as tokens:
                async for token in tokens:
                    trailers.sent(token)
                    yield token

    async def GenerateOpenAI(
        self,
        request: inference_pb2.InferenceRequest,
        context: aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        # A stream the edge's byte-level relay moved here: the parts it delivered as `resume`
        # (the presenter then continues the caller's begun stream).
        request = read_delivered(request, parts=True)
        if request.HasField("resume") and request.sampling.logprobs and not request.openai.chat:
            # A completion's logprobs count text_offset from its first character, which only
            # the first worker's presenter knew.
            raise InvalidArgument(
                "resume", "a completion with logprobs cannot continue on another worker"
            )
        presenter = OpenAIPresenter(request)
        tokens = self.Generate(request, context)
        # For that relay, each streamed part carries the Token it was made from.
        made_from: list[token_pb2.Token] = []
        if request.openai.relayed and presenter.stream:
            tokens = noted(tokens, made_from)
        sent = False
        generated = presenter.parts(tokens)
        async with contextlib.aclosing(generated) as parts:
            async for data in parts:
                if not sent:
                    # The first part's metadata becomes the caller's HTTP headers (the edge's
                    # transcoder): before it, an error is still the call's status.
                    sent = True
                    await context.send_initial_metadata(presenter.headers())
                if made_from:
                    yield relayed_part(presenter.content_type, data, made_from.pop())
                else:
                    yield httpbody_pb2.HttpBody(content_type=presenter.content_type, data=data)

    async def _generate(
        self,
        engine: VllmEngine,
        spec: EngineRequest,
        context: aio.ServicerContext[Any, Any],
        time_limit: float,
    ) -> AsyncGenerator[token_pb2.Token, None]:
        # By the model or adapter it names; a name the worker does not serve (refused
        # NOT_FOUND below) counts as the model's: the label's values are what it serves.
        model = spec.model if spec.model in engine.adapters.names else engine.model_name
        timer = self._stream_metrics.timer(context, model)
        deadline = Deadline.of(context)
        counted = False
        expired = False

        def count_abort() -> None:
            # Called from here or from the engine stream, whichever sees the abort first.
            nonlocal counted
            if not counted:
                counted = True
                reason = "deadline_exceeded" if expired or deadline.passed() else "cancelled"
                self._aborted.labels(reason=reason).inc()

        aborting: list[asyncio.Task[None]] = []

        def expire() -> None:
            # The request's own time limit: the engine request is aborted, and its stream,
            # ending, raises the deadline error (no task is cancelled: the stream may be
            # waiting on its caller, not the engine).
            nonlocal expired
            expired = True
            aborting.append(asyncio.ensure_future(engine.abort(spec.engine_ids)))

        expiry = None
        if time_limit > 0:
            expiry = asyncio.get_running_loop().call_later(time_limit, expire)
        outputs = engine.stream(spec, on_abort=count_abort)
        # The first message's: the request's warnings, or on a resumed stream (whose caller
        # had them from the first worker) how many times it has moved.
        warnings = spec.warnings if spec.resumed is None else ()
        resumed = spec.resumed.attempt if spec.resumed is not None else 0
        try:
            async for tokens in outputs:
                if expired:
                    break
                token = token_message(tokens)
                if warnings:
                    token.warnings.extend(warnings)
                    warnings = ()
                if resumed:
                    token.resumed, resumed = resumed, 0
                timer.sent(token, len(tokens.token_ids), tokens.prompt_tokens)
                yield token
            if expired:
                count_abort()
                raise late(time_limit)
        except asyncio.CancelledError:
            # The caller cancelled, went away or ran out of deadline: free the engine now
            # (closing the stream below does too).
            await engine.abort(spec.engine_ids)
            count_abort()
            raise
        finally:
            if expiry is not None:
                expiry.cancel()
            await outputs.aclose()

    async def GetEngineStats(
        self,
        request: inference_pb2.EngineStatsRequest,
        context: aio.ServicerContext[Any, Any],
    ) -> inference_pb2.EngineStats:
        engine = self._engines.get()
        load = engine.load
        return inference_pb2.EngineStats(
            # Hits read before queries (the stat logger adds queries first): never more hits.
            prefix_cache_hits=load.prefix_cache_hits,
            prefix_cache_queries=load.prefix_cache_queries,
            running_requests=load.running,
            waiting_requests=load.waiting,
            kv_cache_usage=load.kv_cache_usage,
            reported_unix_nanos=load.reported_unix_nanos,
            model=engine.model_name,
            max_model_len=engine.max_model_len,
            adapters=engine.adapters.names,
            held_adapters=await engine.held_adapters(),
        )

    async def Tokenize(
        self,
        request: inference_pb2.TokenizeRequest,
        context: aio.ServicerContext[Any, Any],
    ) -> inference_pb2.TokenizeResponse:
        engine = self._engines.get()
        ids = await engine.tokenize(validate_tokenize(request, self._settings))
        return inference_pb2.TokenizeResponse(
            tokens=ids,
            max_model_len=engine.max_model_len,
            token_strs=engine.token_strs(ids) if request.return_token_strs else (),
        )

    async def Detokenize(
        self,
        request: inference_pb2.DetokenizeRequest,
        context: aio.ServicerContext[Any, Any],
    ) -> inference_pb2.DetokenizeResponse:
        engine = self._engines.get()
        check_token_ids("tokens", request.tokens, engine.vocabulary_size, engine.max_model_len)
        return inference_pb2.DetokenizeResponse(prompt=engine.detokenize(request.tokens))


def relayed_part(content_type: str, data: bytes, token: token_pb2.Token) -> httpbody_pb2.HttpBody:
    """A part of a relayed answer: an HttpBody that also holds its Token (RelayedPart's field,
    which HttpBody keeps as a field it does not know and sends on as it is). Only the Token's
    field is encoded and merged in; the part's data is not copied through a parse."""
    part = httpbody_pb2.HttpBody(content_type=content_type, data=data)
    part.MergeFromString(inference_pb2.RelayedPart(token=token).SerializeToString())
    return part


async def noted(
    tokens: AsyncGenerator[token_pb2.Token, None], made_from: list[token_pb2.Token]
) -> AsyncGenerator[token_pb2.Token, None]:
    """The tokens, each also left in made_from for the part the presenter makes of it (a
    streamed answer makes one part of each message; a part made of none, the last [DONE] after
    a stream that stopped short, finds it empty)."""
    async with contextlib.aclosing(tokens) as each:
        async for token in each:
            made_from[:] = [token]
            yield token
