"""InferenceService RPC handlers: validate, stream the engine's tokens, abort on cancel."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from grpc import aio
from prometheus_client import Counter

from tokenmesh.common.interceptors import Deadline
from tokenmesh.common.metrics import StreamMetrics
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2
from tokenmesh.worker.admission import Admission
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine import EngineSlot, VllmEngine
from tokenmesh.worker.requests import GenerationSpec, validate


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(
        self,
        engines: EngineSlot,
        limits: WorkerSettings,
        stream_metrics: StreamMetrics,
        aborted: Counter,
    ) -> None:
        self._engines = engines
        self._limits = limits
        self._stream_metrics = stream_metrics
        # Engine requests aborted because their caller went away, by reason.
        self._aborted = aborted
        self._admission = Admission(limits.max_num_seqs, limits.max_waiting_requests)

    async def Generate(
        self,
        request: inference_pb2.InferenceRequest,
        context: aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[token_pb2.Token]:
        spec = validate(request, self._limits)
        engine = self._engines.get()
        # Closing the inner stream (the caller went away) aborts the engine request.
        with self._admission.admit(engine.load.waiting):
            async with contextlib.aclosing(self._generate(engine, spec, context)) as tokens:
                async for token in tokens:
                    yield token

    async def _generate(
        self, engine: VllmEngine, spec: GenerationSpec, context: aio.ServicerContext[Any, Any]
    ) -> AsyncGenerator[token_pb2.Token, None]:
        timer = self._stream_metrics.timer(context)
        deadline = Deadline(context)
        counted = False

        def count_abort() -> None:
            # Called from here or from the engine stream, whichever sees the abort first.
            nonlocal counted
            if not counted:
                counted = True
                reason = "deadline_exceeded" if deadline.passed() else "cancelled"
                self._aborted.labels(reason=reason).inc()

        deltas = engine.stream(spec, on_abort=count_abort)
        try:
            async for delta in deltas:
                token = token_pb2.Token(
                    text=delta.text,
                    index=delta.index,
                    token_id=delta.token_id,
                    finish_reason=delta.finish_reason,  # type: ignore[arg-type]
                    emitted_unix_nanos=time.time_ns(),
                )
                if delta.logprob is not None:
                    token.logprob = delta.logprob
                for candidate in delta.top_logprobs:
                    token.top_logprobs.add(
                        token_id=candidate.token_id, text=candidate.text, logprob=candidate.logprob
                    )
                if delta.finish_reason:
                    token.usage.prompt_tokens = delta.prompt_tokens
                    token.usage.completion_tokens = delta.index + (delta.token_id >= 0)
                timer.sent(token, prompt_tokens=delta.prompt_tokens)
                yield token
        except asyncio.CancelledError:
            # The caller cancelled, went away or ran out of deadline: free the engine now
            # (closing the stream below does too).
            await engine.abort(spec.request_id)
            count_abort()
            raise
        finally:
            await deltas.aclose()

    async def GetEngineStats(
        self,
        request: inference_pb2.EngineStatsRequest,
        context: aio.ServicerContext[Any, Any],
    ) -> inference_pb2.EngineStats:
        engine = self._engines.get()
        load = engine.load
        return inference_pb2.EngineStats(
            running_requests=load.running,
            waiting_requests=load.waiting,
            kv_cache_usage=load.kv_cache_usage,
            reported_unix_nanos=load.reported_unix_nanos,
            model=engine.model_name,
            max_model_len=engine.max_model_len,
        )
