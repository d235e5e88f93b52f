"""InferenceService RPC handlers: validate, stream the engine's tokens, abort on cancel."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from google.api import httpbody_pb2
from grpc import aio
from prometheus_client import Counter

from tokenmesh.common.errors import DeadlineExceeded
from tokenmesh.common.metrics import StreamMetrics
from tokenmesh.common.openai_answers import EventStream, Shape, WholeAnswer, error_response
from tokenmesh.common.outcome import Deadline
from tokenmesh.common.tokens import DEGRADED_HEADER, USAGE_TRAILER, usage_trailer
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2
from tokenmesh.worker.admission import Admission
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine import Candidate, EngineSlot, Tokens, VllmEngine
from tokenmesh.worker.requests import GenerationSpec, validate

EVENT_STREAM = "text/event-stream"


def late(limit: float) -> DeadlineExceeded:
    return DeadlineExceeded(f"deadline exceeded: the answer's time limit of {limit:g} s passed")


def degraded_marker(context: aio.ServicerContext[Any, Any]) -> tuple[tuple[str, str], ...]:
    """The degraded marker the gateway set on a request it prepared, to return to the caller."""
    return tuple(
        (k, str(v)) for k, v in context.invocation_metadata() or () if k == DEGRADED_HEADER
    )[:1]


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
    if tokens.finish_reason:
        token.usage.prompt_tokens = tokens.prompt_tokens
        token.usage.completion_tokens = tokens.index + len(ids)
    return token


def add_candidates(field: Any, top: tuple[Candidate, ...]) -> None:
    """Each candidate into a repeated TokenLogprob field, built in place (no copies)."""
    for candidate in top:
        field.add(token_id=candidate.token_id, text=candidate.text, logprob=candidate.logprob)


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(
        self,
        engines: EngineSlot,
        settings: WorkerSettings,
        stream_metrics: StreamMetrics,
        aborted: Counter,
    ) -> None:
        self._engines = engines
        self._settings = settings
        self._stream_metrics = stream_metrics
        # Engine requests aborted because their caller went away, by reason.
        self._aborted = aborted
        self._admission = Admission(settings.max_num_seqs, settings.max_waiting_requests)

    async def Generate(
        self,
        request: inference_pb2.InferenceRequest,
        context: aio.ServicerContext[Any, Any],
    ) -> AsyncGenerator[token_pb2.Token, None]:
        spec = validate(request, self._settings)
        # A degraded answer the gateway prepared for Envoy to stream from here: its trailer.
        trailers = degraded_marker(context)
        if trailers:
            context.set_trailing_metadata(trailers)
        engine = self._engines.get()
        messages = 0
        # Closing the inner stream (the caller went away) aborts the engine request.
        with self._admission.admit(engine.load.waiting):
            # An OpenAI answer's own time limit (GenerateOpenAI's; 0 for others).
            time_limit = request.openai.time_limit_seconds
            generated = self._generate(engine, spec, context, time_limit)
            async with contextlib.aclosing(generated) as tokens:
                async for token in tokens:
                    messages += 1
                    if token.finish_reason:
                        usage = token.usage
                        value = usage_trailer(
                            usage.prompt_tokens, usage.completion_tokens, messages
                        )
                        context.set_trailing_metadata((*trailers, (USAGE_TRAILER, value)))
                    yield token

    async def GenerateOpenAI(
        self,
        request: inference_pb2.InferenceRequest,
        context: aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        answer = request.openai
        shape = Shape.of(answer)
        logprobs = request.sampling.logprobs
        # Sent with the first event (the transcoder makes them the caller's HTTP headers):
        # before it, an error is still the call's status, which the edge answers with its
        # HTTP status.
        headers = degraded_marker(context)
        async with contextlib.aclosing(self.Generate(request, context)) as tokens:
            if not answer.stream:
                whole = WholeAnswer(shape, logprobs)
                async for token in tokens:
                    whole.add(token)
                await context.send_initial_metadata(headers)
                data = json.dumps(whole.body(), separators=(",", ":")).encode()
                yield httpbody_pb2.HttpBody(content_type="application/json", data=data)
                return
            events = EventStream(shape, logprobs, answer.include_usage)
            started = False
            try:
                async for token in tokens:
                    data = events.token(token)
                    if not started:
                        started = True
                        await context.send_initial_metadata(
                            (*headers, ("cache-control", "no-cache"))
                        )
                        data = events.start() + data
                    yield httpbody_pb2.HttpBody(content_type=EVENT_STREAM, data=data)
            except Exception as exc:
                if not started:
                    raise
                # The answer has begun (HTTP 200 sent): the error goes in the stream, as
                # OpenAI's servers send it, and the call still ends with its status.
                _, body, _ = error_response(exc)
                yield httpbody_pb2.HttpBody(content_type=EVENT_STREAM, data=events.failed(body))
                raise

    async def _generate(
        self,
        engine: VllmEngine,
        spec: GenerationSpec,
        context: aio.ServicerContext[Any, Any],
        time_limit: float,
    ) -> AsyncGenerator[token_pb2.Token, None]:
        timer = self._stream_metrics.timer(context)
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
            aborting.append(asyncio.ensure_future(engine.abort(spec.request_id)))

        expiry = None
        if time_limit > 0:
            expiry = asyncio.get_running_loop().call_later(time_limit, expire)
        outputs = engine.stream(spec, on_abort=count_abort)
        warnings = spec.warnings
        try:
            async for tokens in outputs:
                if expired:
                    break
                token = token_message(tokens)
                if warnings:
                    token.warnings.extend(warnings)
                    warnings = ()
                timer.sent(token, len(tokens.token_ids), tokens.prompt_tokens)
                yield token
            if expired:
                count_abort()
                raise late(time_limit)
        except asyncio.CancelledError:
            # The caller cancelled, went away or ran out of deadline: free the engine now
            # (closing the stream below does too).
            await engine.abort(spec.request_id)
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
        )
