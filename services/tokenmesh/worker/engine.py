"""The vLLM engine adapter: owns one AsyncLLM, streams token deltas, aborts, reports load."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
from vllm.v1.metrics.loggers import StatLoggerBase

from tokenmesh.common.errors import Internal, InvalidArgument, Unavailable
from tokenmesh.v1 import token_pb2
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.requests import GenerationSpec

log = logging.getLogger(__name__)

FINISH_REASONS = {
    "stop": token_pb2.FINISH_REASON_STOP,
    "length": token_pb2.FINISH_REASON_LENGTH,
    "abort": token_pb2.FINISH_REASON_ABORTED,
}


@dataclass
class EngineLoad:
    """The scheduler's latest report: what vLLM itself says is running and waiting."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    reported_unix_nanos: int = 0


class _LoadStatLogger(StatLoggerBase):
    """A vLLM stat logger that keeps the scheduler's figures in an EngineLoad.

    vLLM calls record() on the event loop after every engine step, including the step that
    clears aborted requests, so the figures are fresh within one step.
    """

    def __init__(self, load: EngineLoad) -> None:
        self._load = load

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is None:
            return
        self._load.running = scheduler_stats.num_running_reqs
        self._load.waiting = (
            scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
        )
        self._load.kv_cache_usage = scheduler_stats.kv_cache_usage
        self._load.reported_unix_nanos = time.time_ns()

    def log_engine_initialized(self) -> None:
        pass


@dataclass(frozen=True)
class Candidate:
    """A token the model considered at one position, with its log probability."""

    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenDelta:
    """One generated token as the engine produced it."""

    index: int
    token_id: int
    text: str
    # Set on the last token only.
    finish_reason: int = token_pb2.FINISH_REASON_UNSPECIFIED
    prompt_tokens: int = 0
    # Set when the request asked for logprobs: this token's, and the most likely alternatives.
    logprob: float | None = None
    top_logprobs: tuple[Candidate, ...] = ()


def token_logprobs(
    position_logprobs: Any, token_id: int, top: int
) -> tuple[float | None, tuple[Candidate, ...]]:
    """This token's logprob and the `top` best candidates from vLLM's {token_id: Logprob} of
    one position (which holds the sampled token, ranked, plus the top alternatives)."""
    if not position_logprobs:
        return None, ()
    sampled = position_logprobs.get(token_id)
    ranked = sorted(
        (entry.rank or 0, candidate, entry) for candidate, entry in position_logprobs.items()
    )
    candidates = tuple(
        Candidate(candidate, entry.decoded_token or "", entry.logprob)
        for rank, candidate, entry in ranked
        if 0 < rank <= top
    )
    return (sampled.logprob if sampled is not None else None), candidates


def engine_args(settings: WorkerSettings) -> AsyncEngineArgs:
    return AsyncEngineArgs(
        model=settings.model,
        served_model_name=settings.served_model_name,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        tensor_parallel_size=settings.tensor_parallel_size,
        trust_remote_code=settings.trust_remote_code,
        max_logprobs=settings.max_top_logprobs,
        # vLLM's per-request log lines stay off (its default, stated here because prompts
        # must never reach the logs; README "No prompt text in logs").
        enable_log_requests=False,
    )


def configure_cpu_backend(settings: WorkerSettings) -> None:
    """vLLM's CPU backend reads its KV-cache size and core binding from the environment only."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_space_gib)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = settings.cpu_threads_bind


class VllmEngine:
    """One vLLM AsyncLLM shared by every stream of the worker (continuous batching)."""

    def __init__(self, llm: AsyncLLM, load: EngineLoad, settings: WorkerSettings) -> None:
        self._llm = llm
        self.load = load
        self.model_name = settings.model_name
        self.max_model_len = settings.max_model_len
        # Tokenize without vLLM's own length check: ours below names the fields and limits.
        self._tokenize_params = dataclasses.replace(
            llm.renderer.default_cmpl_tok_params, max_total_tokens=None
        )

    @classmethod
    async def start(cls, settings: WorkerSettings) -> VllmEngine:
        """Load the model (in a thread, so the server keeps answering health checks) and warm up."""
        configure_cpu_backend(settings)
        load = EngineLoad()
        llm = await asyncio.to_thread(
            AsyncLLM.from_engine_args,
            engine_args(settings),
            stat_loggers=[lambda _config, _index: _LoadStatLogger(load)],
        )
        engine = cls(llm, load, settings)
        await engine.warm_up()
        return engine

    async def warm_up(self) -> None:
        """Generate one token, which also starts AsyncLLM's output tasks on this event loop."""
        spec = GenerationSpec(
            request_id="warm-up",
            prompt="warm up",
            max_tokens=1,
            temperature=0.0,
            top_p=1.0,
            top_k=-1,
            seed=None,
            stop=(),
            ignore_eos=True,
        )
        async for _ in self.stream(spec):
            pass

    @property
    def errored(self) -> bool:
        return bool(self._llm.errored)

    async def _tokenize(self, spec: GenerationSpec) -> Any:
        (engine_input,) = await self._llm.renderer.render_cmpl_async(
            [{"prompt": spec.prompt}], self._tokenize_params
        )
        prompt_tokens = len(engine_input["prompt_token_ids"])
        if prompt_tokens + spec.max_tokens > self.max_model_len:
            if prompt_tokens >= self.max_model_len:
                raise InvalidArgument(
                    "prompt",
                    f"is {prompt_tokens} tokens; the model context is {self.max_model_len} tokens",
                )
            raise InvalidArgument(
                "max_tokens",
                f"{spec.max_tokens} plus the prompt's {prompt_tokens} tokens exceeds the model "
                f"context of {self.max_model_len} tokens (at most "
                f"{self.max_model_len - prompt_tokens} here)",
            )
        return engine_input

    def _sampling_params(self, spec: GenerationSpec) -> SamplingParams:
        return SamplingParams(
            max_tokens=spec.max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            seed=spec.seed,
            stop=list(spec.stop) or None,
            ignore_eos=spec.ignore_eos,
            # vLLM returns the sampled token's logprob plus this many alternatives.
            logprobs=spec.top_logprobs if spec.logprobs else None,
            # Each output carries only what is new since the last one: the token stream.
            output_kind=RequestOutputKind.DELTA,
        )

    async def stream(
        self, spec: GenerationSpec, on_abort: Callable[[], None] | None = None
    ) -> AsyncGenerator[TokenDelta, None]:
        """Yield each token the moment vLLM produces it. Closing or cancelling the iterator
        before the last token aborts the engine request, and calls on_abort once."""
        engine_input = await self._tokenize(spec)
        prompt_tokens = len(engine_input["prompt_token_ids"])
        index = 0
        try:
            async for output in self._llm.generate(
                engine_input, self._sampling_params(spec), spec.request_id
            ):
                completion = output.outputs[0]
                token_ids = completion.token_ids
                finish = FINISH_REASONS.get(completion.finish_reason or "", 0)
                last = len(token_ids) - 1
                for position, token_id in enumerate(token_ids):
                    logprob, top = (
                        token_logprobs(completion.logprobs[position], token_id, spec.top_logprobs)
                        if completion.logprobs
                        else (None, ())
                    )
                    # A step normally yields one token; if it yields several, the new text
                    # cannot be split between them and rides on the last one.
                    yield TokenDelta(
                        index=index,
                        token_id=token_id,
                        text=completion.text if position == last else "",
                        finish_reason=finish if position == last and output.finished else 0,
                        prompt_tokens=prompt_tokens,
                        logprob=logprob,
                        top_logprobs=top,
                    )
                    index += 1
                if output.finished and not token_ids:
                    # Nothing new but the end (e.g. the engine aborted the request): report the
                    # finish on a message that is not a token (token_id -1).
                    yield TokenDelta(
                        index,
                        -1,
                        completion.text,
                        finish or token_pb2.FINISH_REASON_ABORTED,
                        prompt_tokens,
                    )
        except (asyncio.CancelledError, GeneratorExit):
            await self.abort(spec.request_id)
            if on_abort is not None:
                on_abort()
            raise
        except EngineDeadError as exc:
            raise Unavailable(f"inference engine is down: {exc}") from exc
        except VLLMValidationError as exc:
            raise InvalidArgument(exc.parameter or "request", str(exc)) from exc
        except EngineGenerateError as exc:
            raise Internal(f"inference engine failed the request: {exc}") from exc

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    def close(self) -> None:
        self._llm.shutdown()


class EngineSlot:
    """Holds the engine once it has loaded; RPCs before that get UNAVAILABLE."""

    def __init__(self) -> None:
        self._engine: VllmEngine | None = None

    def set(self, engine: VllmEngine) -> None:
        self._engine = engine

    def get(self) -> VllmEngine:
        if self._engine is None:
            raise Unavailable("worker: the model is still loading")
        return self._engine
