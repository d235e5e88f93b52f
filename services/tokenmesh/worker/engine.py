"""The vLLM engine adapter: owns one AsyncLLM, streams token deltas, aborts, reports load."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import os
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from vllm import envs as vllm_envs
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.lora.request import LoRARequest
from vllm.renderers import ChatParams
from vllm.renderers.chat_utils import ChatTemplateResolutionError
from vllm.usage.usage_lib import UsageContext
from vllm.utils.gc_utils import freeze_gc_heap
from vllm.utils.mistral import is_mistral_tokenizer
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
from vllm.v1.metrics.loggers import StatLoggerBase

from tokenmesh.common.errors import Internal, InvalidArgument, Unavailable
from tokenmesh.v1 import inference_pb2, token_pb2
from tokenmesh.worker.adapters import AdapterMetrics, Adapters
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.continuation import ContinuedText, continue_choice
from tokenmesh.worker.engine_state import EngineLoad, EngineShare
from tokenmesh.worker.engine_thread import EngineThread, Handoff, Inbox, Item
from tokenmesh.worker.outputs import PromptPart, Tokens, output_tokens, prompt_part
from tokenmesh.worker.pacing import StreamPacing
from tokenmesh.worker.parsing import OutputParsers
from tokenmesh.worker.requests import (
    Continuation,
    EngineRequest,
    Message,
    PromptItem,
    TokenizeSpec,
    check_token_ids,
)
from tokenmesh.worker.sampling import EngineSampling, engine_options
from tokenmesh.worker.watchdog import EngineActivity

log = logging.getLogger(__name__)

T = TypeVar("T")


class _LoadStatLogger(StatLoggerBase):
    """A vLLM stat logger that keeps the scheduler's figures in an EngineLoad, and marks each
    step in the engine's activity (the stall watchdog's sign of progress).

    vLLM calls record() on the event loop after every engine step, including the step that
    clears aborted requests, so the figures are fresh within one step.
    """

    def __init__(self, load: EngineLoad, activity: EngineActivity) -> None:
        self._load = load
        self._activity = activity

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        self._activity.stepped()
        if scheduler_stats is None:
            return
        # This step's lookups, as vLLM's own counters take them (preempted requests' repeat
        # lookups left out).
        prefix = scheduler_stats.prefix_cache_stats
        self._load.report(
            running=scheduler_stats.num_running_reqs,
            waiting=scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
            kv_cache_usage=scheduler_stats.kv_cache_usage,
            queries=prefix.queries,
            hits=prefix.hits,
        )

    def log_engine_initialized(self) -> None:
        pass


def configure_vllm_environment(settings: WorkerSettings) -> None:
    """What vLLM reads from the environment only: whether forced tool calls use structural tags
    (read as its tool parsers are imported), and its CPU backend's KV-cache size, core binding
    and compile cache."""
    from vllm.platforms import current_platform

    os.environ["VLLM_ENFORCE_STRICT_TOOL_CALLING"] = str(int(settings.enforce_strict_tool_calling))

    if current_platform.is_cpu():
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_space_gib)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = settings.cpu_threads_bind
        # The pinned vLLM on CPU cannot reload the model it compiled ahead of time ("'function'
        # object has no attribute 'finalize_loading'" from its mega-artifact loader): every
        # start failed the load, traced the model again and saved it again, 4 of an engine's
        # 8 s of initialisation. Without that cache the trace is the same and nothing is
        # saved. An operator's own VLLM_USE_AOT_COMPILE wins.
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


@dataclass
class _Run:
    """A request's engine requests (one per prompt of a batch) as they run: where their tokens
    go, the prompt tokens of all, the completion tokens so far, and how many still run."""

    post: Callable[[Item], None]
    prompt_tokens: int
    running: int
    generated: int = 0


def _mapped(error: Exception, subject: str = "request") -> Exception:
    """vLLM's errors as the status errors the caller gets; subject is the field a validation
    error names when vLLM names none (messages, for a template that rejects them)."""
    if isinstance(error, EngineDeadError):
        return Unavailable(f"inference engine is down: {error}")
    if isinstance(error, ChatTemplateResolutionError):
        # As vLLM's chat completions answer (400): the request, not the worker, must change.
        return InvalidArgument(
            "messages", "the model has no chat template to render them with; send a prompt"
        )
    if isinstance(error, VLLMValidationError):
        return InvalidArgument(error.parameter or subject, str(error))
    if isinstance(error, EngineGenerateError):
        return Internal(f"inference engine failed the request: {error}")
    return error


class VllmEngine:
    """One vLLM AsyncLLM shared by every stream of the worker (continuous batching), running on
    its own thread; its methods are called from the gRPC server's loop."""

    def __init__(
        self,
        llm: AsyncLLM,
        load: EngineLoad,
        settings: WorkerSettings,
        thread: EngineThread,
        activity: EngineActivity | None = None,
        adapter_metrics: AdapterMetrics | None = None,
    ) -> None:
        self._llm = llm
        self._thread = thread
        self._server_loop = asyncio.get_running_loop()
        # While the server's loop is behind, a stream's later tokens gather (decision 0039).
        self.pacing = StreamPacing(
            settings.stream_hold_lag_ms / 1000, settings.stream_hold_max_ms / 1000
        )
        self._handoff = Handoff(self._server_loop, self.pacing)
        # A message holds at most this many tokens (merged outputs, or a piece of a longer one).
        self._per_message = settings.max_message_tokens
        self.load = load
        # The requests the engine holds, and its steps (marked by the stat logger given the
        # same activity), for the stall watchdog.
        self.activity = activity or EngineActivity()
        self.model_name = settings.model_name
        # The model's LoRA adapters, by the names requests give them.
        self.adapters = Adapters.of(settings, adapter_metrics)
        # The context and batch vLLM settled on (the settings' or its defaults).
        self.max_model_len: int = llm.model_config.max_model_len
        self.max_num_seqs: int = llm.vllm_config.scheduler_config.max_num_seqs
        # Tokenize without vLLM's own length check: ours below names the fields and limits.
        self._tokenize_params = dataclasses.replace(
            llm.renderer.default_cmpl_tok_params, max_total_tokens=None
        )
        self._chat_tokenize_params = dataclasses.replace(
            llm.renderer.default_chat_tok_params, max_total_tokens=None
        )
        # Engine parameters by vLLM's own rules; the worker's default temperature where a
        # request names none.
        self._sampling = EngineSampling(llm, {"temperature": settings.default_temperature})
        # The model's tokenizer (vLLM's: a model always has one here).
        self._tokenizer: Any = llm.renderer.tokenizer
        # Tool calls and reasoning in conversations' outputs, by vLLM's parsers.
        self._parsers = OutputParsers(settings, llm.renderer.tokenizer, llm.model_config)
        # False once vLLM found no chat template for the model (it looks on every render).
        self._has_chat_template = True
        # What vLLM's chat completions render with by default: the model's own template, the
        # assistant's generation prompt after the last message, rendered as text and then
        # tokenized without added special tokens (the template places them).
        self._chat_params = ChatParams(
            chat_template_kwargs={
                "add_generation_prompt": True,
                "continue_final_message": False,
                "tokenize": is_mistral_tokenizer(llm.renderer.tokenizer),
            }
        )

    @classmethod
    async def start(
        cls,
        settings: WorkerSettings,
        arguments: AsyncEngineArgs,
        share: EngineShare | None = None,
        adapter_metrics: AdapterMetrics | None = None,
    ) -> VllmEngine:
        """Load the model on the engine's thread (the server keeps answering health checks
        meanwhile) and warm up; arguments: the engine's (worker/engine_args.py). share: this
        process is one of several front ends over an engine the worker's supervisor started
        (worker/frontends.py); without it, the engine's processes are this one's own."""
        configure_vllm_environment(settings)
        load = share.load if share is not None else EngineLoad()
        activity = EngineActivity(steps=share.steps if share is not None else None)
        thread = EngineThread()
        thread.start()
        # vLLM's defaults as `vllm serve` has them (its batch sizes by hardware).
        usage = UsageContext.OPENAI_API_SERVER
        loggers: list[Any] = [lambda _config, _index: _LoadStatLogger(load, activity)]

        async def build() -> AsyncLLM:
            # Blocks the engine's loop for the load, when nothing else runs on it; built inside
            # the running loop, AsyncLLM starts its output tasks there.
            if share is None:
                return AsyncLLM.from_engine_args(
                    arguments, usage_context=usage, stat_loggers=loggers
                )
            # As each of `vllm serve --api-server-count N`'s API servers builds its client.
            mine = copy.copy(arguments)
            mine._api_process_count, mine._api_process_rank = share.count, share.index
            return AsyncLLM.from_vllm_config(
                mine.create_engine_config(usage),
                usage_context=usage,
                stat_loggers=loggers,
                client_addresses=share.client,
                client_count=share.count,
                client_index=share.index,
            )

        try:
            llm = await thread.call(build())
        except asyncio.CancelledError:
            # Stopped while loading: the worker exits now, not when the load returns (minutes
            # on a GPU); the engine's processes end with it (lifetime.py).
            thread.abandon()
            raise
        except BaseException:
            thread.stop()
            raise
        engine = cls(llm, load, settings, thread, activity, adapter_metrics)
        if llm.vllm_config.lora_config is not None:
            engine.adapters.max_rank = llm.vllm_config.lora_config.max_lora_rank
            # vLLM sets max_cpu_loras (max_loras unless given) as it builds the engine.
            capacity = llm.vllm_config.lora_config.max_cpu_loras or 1
            await thread.call(engine.adapters.load(llm, capacity))
        await engine.warm_up()
        # As vLLM's own server does once started: the start-up heap (torch, transformers, the
        # model's Python objects) leaves the collector's view, so a full collection no longer
        # walks it and stops both loops for a second.
        freeze_gc_heap()
        # As vLLM's engine processes do once started: each read of a vLLM variable (one per
        # engine output, in the output processing this process runs) is then a cached value,
        # not a parse of the environment (0.4 against 2.4 µs measured). The worker sets
        # vLLM's variables before the engine starts (configure_vllm_environment), never after.
        vllm_envs.enable_envs_cache()
        return engine

    async def warm_up(self) -> None:
        """Generate one token through the whole path."""
        spec = EngineRequest(
            request_id="warm-up",
            prompt="warm up",
            max_tokens=1,
            options=engine_options(
                inference_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                "warm up",
            ),
        )
        async for _ in self.stream(spec):
            pass

    @property
    def errored(self) -> bool:
        return bool(self._llm.errored)

    async def _tokenize(
        self, spec: EngineRequest, item: PromptItem | None = None, position: int = 0
    ) -> tuple[Any, int]:
        """The engine input of a prompt (or of a batch's prompt `item`, at `position`), or of
        messages rendered with the chat template (the prompt, when the model has none and the
        request carries one); and the tokens it may generate."""
        engine_input = None
        subject, whose, size = "messages", "messages'", "are {} tokens with the chat template"
        if item is not None:
            subject, size = spec.prompt_field(position), "is {} tokens"
            whose = f"{subject}'s"
            if item.token_ids:
                check_token_ids(subject, item.token_ids, self.vocabulary_size, self.max_model_len)
            (engine_input,) = await self._llm.renderer.render_cmpl_async(
                [
                    {"prompt_token_ids": list(item.token_ids)}
                    if item.token_ids
                    else {"prompt": item.text}
                ],
                self._tokenize_params,
            )
        elif spec.messages and (self._has_chat_template or not spec.prompt):
            try:
                engine_input = await self._render_chat(spec.messages, spec.options)
            except ChatTemplateResolutionError:
                # Learnt once: later requests with a fallback go straight to it.
                self._has_chat_template = False
                if not spec.prompt:
                    raise
        if engine_input is None:
            (engine_input,) = await self._llm.renderer.render_cmpl_async(
                [{"prompt": spec.prompt}], self._tokenize_params
            )
            subject, whose, size = "prompt", "prompt's", "is {} tokens"
        prompt_tokens = len(engine_input["prompt_token_ids"])
        if prompt_tokens >= self.max_model_len:
            raise InvalidArgument(
                subject,
                f"{size.format(prompt_tokens)}; the model context is {self.max_model_len} tokens",
            )
        room = self.max_model_len - prompt_tokens
        if spec.max_tokens_within_context:
            return engine_input, min(spec.max_tokens, room)
        if spec.max_tokens > room:
            raise InvalidArgument(
                "max_tokens",
                f"{spec.max_tokens} plus the {whose} {prompt_tokens} tokens exceeds the model "
                f"context of {self.max_model_len} tokens (at most {room} here)",
            )
        return engine_input, spec.max_tokens

    async def _render_chat(
        self,
        messages: Sequence[Message],
        options: Any,
        add_generation_prompt: bool = True,
        add_special_tokens: bool | None = None,
    ) -> Any:
        conversation: list[Any] = [message.as_openai() for message in messages]
        params, tok_params = self._chat_params, self._chat_tokenize_params
        if not add_generation_prompt:
            params = dataclasses.replace(
                params,
                chat_template_kwargs={
                    **params.chat_template_kwargs,
                    "add_generation_prompt": False,
                },
            )
        if add_special_tokens is not None:
            tok_params = dataclasses.replace(tok_params, add_special_tokens=add_special_tokens)
        tools = getattr(options, "tools", None)
        if tools:
            # The tools for the template to describe to the model, as vLLM's server gives them.
            params = params.with_defaults({"tools": [tool.model_dump() for tool in tools]})
        _, (engine_input,) = await self._llm.renderer.render_chat_async(
            [conversation], params, tok_params
        )
        return engine_input

    async def tokenize(self, spec: TokenizeSpec) -> list[int]:
        """The tokens a generation of this prompt, or of these messages rendered with the
        model's chat template, would start from (vLLM's /tokenize), rendered on the engine's
        loop as a generation's are."""

        async def render() -> Any:
            if spec.messages:
                return await self._render_chat(
                    spec.messages, spec.options, spec.add_generation_prompt, spec.add_special_tokens
                )
            params = self._tokenize_params
            if spec.add_special_tokens is not None:
                params = dataclasses.replace(params, add_special_tokens=spec.add_special_tokens)
            (made,) = await self._llm.renderer.render_cmpl_async([{"prompt": spec.prompt}], params)
            return made

        try:
            engine_input = await self._thread.call(render())
        except Exception as error:
            raise _mapped(error, "messages" if spec.messages else "prompt") from error
        return list(engine_input["prompt_token_ids"])

    @property
    def vocabulary_size(self) -> int:
        return len(self._tokenizer)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return list(self._tokenizer.convert_ids_to_tokens(list(ids)))

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of these vocabulary ids (vLLM's /detokenize)."""
        return str(self._tokenizer.decode(list(ids)))

    async def _produce(self, spec: EngineRequest, post: Callable[[Item], None]) -> None:
        """On the engine's loop: post each output's tokens, then None at the end, or the error
        that ended the request. Cancelling this aborts the engine request (vLLM's generate()
        does so when cancelled), every prompt's of a batch. The engine holds the request from
        here to its end."""
        self.activity.request_started()
        try:
            # Adjusts the options first (forced tool calls become structured outputs).
            parsing = self._parsers.for_request(spec.options)
            if spec.prompts:
                inputs = [
                    await self._tokenize(spec, item, position)
                    for position, item in enumerate(spec.prompts)
                ]
            else:
                inputs = [await self._tokenize(spec)]
            # The adapter it names, held by the engine (loaded now if need be): once for every
            # prompt and choice of the request.
            lora = await self.adapters.ensure(self._llm, spec.model)
            run = _Run(
                post,
                prompt_tokens=sum(len(made["prompt_token_ids"]) for made, _ in inputs),
                running=len(inputs),
            )
            # A batch's prompts run side by side; one failing ends the others.
            async with asyncio.TaskGroup() as group:
                if spec.resumed is not None:
                    if parsing is not None:
                        raise InvalidArgument(
                            "resume",
                            "a conversation whose output the worker parses (reasoning, tool "
                            "calls) cannot continue on another worker",
                        )
                    run.running = len(spec.resumed.continuations)
                    run.generated = spec.resumed.delivered
                    for continuation in spec.resumed.continuations:
                        position = continuation.choice // spec.n
                        engine_input, max_tokens = inputs[position]
                        group.create_task(
                            self._generate(
                                spec,
                                run,
                                position,
                                engine_input,
                                max_tokens,
                                lora,
                                None,
                                continuation,
                            )
                        )
                else:
                    for position, (engine_input, max_tokens) in enumerate(inputs):
                        group.create_task(
                            self._generate(
                                spec, run, position, engine_input, max_tokens, lora, parsing
                            )
                        )
            post(None)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            if isinstance(error, ExceptionGroup):
                error = error.exceptions[0]
            post(_mapped(error, "messages" if spec.messages else "request"))
        finally:
            self.activity.request_ended()

    async def _generate(
        self,
        spec: EngineRequest,
        run: _Run,
        position: int,
        engine_input: Any,
        max_tokens: int,
        lora: LoRARequest | None,
        parsing: Any,
        continuation: Continuation | None = None,
    ) -> None:
        """One prompt's engine request: its choices' tokens, numbered after the choices of the
        batch's earlier prompts; the tokens that end the last request still running end the
        stream (with the completion tokens of all). With a continuation, one choice of a
        resumed stream: its delivered tokens appended to the prompt as ids, numbered on from
        them, and generated to the request's max_tokens in all."""
        prompt_ids = engine_input["prompt_token_ids"]
        first_choice = position * spec.n
        # Each choice's next position; the prompt, for each choice's first tokens.
        positions: dict[int, int] = {}
        prompt: PromptPart | None = None
        engine_id = spec.engine_id(position, continuation)
        text: ContinuedText | None = None
        params = self._sampling.params(spec.options, max_tokens, spec.prompt_logprobs)
        if continuation is not None:
            delivered = list(continuation.token_ids)
            check_token_ids("resume.token_ids", delivered, self.vocabulary_size, self.max_model_len)
            if len(delivered) >= max_tokens:
                # Its last token came without its end: the end alone.
                ended = Tokens(
                    len(delivered), [], "", token_pb2.FINISH_REASON_LENGTH, run.prompt_tokens
                )
                self._post_end(run, ended, continuation.choice)
                return
            engine_input = continue_choice(params, prompt_ids, delivered, max_tokens)
            first_choice = continuation.choice
            positions[first_choice] = len(delivered)
            text = ContinuedText(self._tokenizer, engine_id, prompt_ids, params)
            text.delivered(delivered)
        async for output in self._llm.generate(engine_input, params, engine_id, lora_request=lora):
            # The prompt's logprobs come with the first output that has any.
            if (
                continuation is None
                and spec.wants_prompt
                and prompt is None
                and (params.prompt_logprobs is None or output.prompt_logprobs is not None)
            ):
                prompt = self._prompt(spec, position, prompt_ids, output.prompt_logprobs, params)
            # Each choice's new tokens (vLLM's deltas; several choices interleave, and one
            # step may end more than one of them).
            final = len(output.outputs) - 1 if output.finished else -1
            for index, completion in enumerate(output.outputs):
                choice = first_choice + completion.index
                tokens = output_tokens(
                    completion, positions.get(choice, 0), run.prompt_tokens, spec.top_logprobs
                )
                tokens.choice = choice
                if text is not None:
                    tokens.text = text.next(tokens.token_ids, output.finished)
                    tokens.text_lengths = None  # the whole text on the last token
                if spec.echo_only:
                    tokens.token_ids, tokens.text, tokens.logprobs = [], "", []
                    tokens.text_lengths = None
                if choice not in positions:
                    tokens.prompt = prompt
                positions[choice] = tokens.index + len(tokens.token_ids)
                run.generated += len(tokens.token_ids)
                if parsing is not None:
                    parsing.parse(tokens, prompt_ids)
                if index == final:
                    tokens.finish_reason = tokens.finish_reason or token_pb2.FINISH_REASON_ABORTED
                    self._post_end(run, tokens, choice)
                else:
                    run.post(tokens)

    @staticmethod
    def _post_end(run: _Run, tokens: Tokens, choice: int) -> None:
        """A choice's last tokens; the last choice's end the stream (with the completion
        tokens of all)."""
        tokens.choice = choice
        run.running -= 1
        if not run.running:
            tokens.last, tokens.completion_tokens = True, run.generated
        run.post(tokens)

    def _prompt(
        self,
        spec: EngineRequest,
        position: int,
        prompt_ids: Sequence[int],
        prompt_logprobs: Any,
        params: Any,
    ) -> PromptPart:
        """The prompt as a choice's first tokens carry it: its text with echo (a batch's ids
        decoded), and its tokens' logprobs when the engine computed them."""
        text = ""
        if spec.echo:
            item = spec.prompts[position] if spec.prompts else PromptItem(spec.prompt)
            text = item.text or self.detokenize(item.token_ids)
        if params.prompt_logprobs is None:
            prompt_logprobs = None
        return prompt_part(
            text,
            prompt_ids,
            prompt_logprobs,
            params.prompt_logprobs or 0,
            lambda token_id: self.detokenize([token_id]),
        )

    async def held_adapters(self) -> tuple[str, ...]:
        """The adapters the engine holds now (none without adapters: no call to the engine)."""
        if not self.adapters.names:
            return ()
        return await self._thread.call(self.adapters.held(self._llm))

    async def add_adapter(self, name: str, directory: Path) -> tuple[int, bool]:
        """Serves an adapter and loads it into the engine now: its id and whether it is new."""
        request, new = await self._thread.call(self.adapters.add(self._llm, name, directory))
        return request.lora_int_id, new

    async def unload_adapter(self, name: str) -> bool:
        """Drops an adapter from the engine (still served): whether the engine held it."""
        return await self._thread.call(self.adapters.unload(self._llm, name))

    async def forget_adapter(self, name: str) -> bool:
        """Stops serving an adapter: whether the engine held it."""
        return await self._thread.call(self.adapters.forget(self._llm, name))

    async def stream(
        self, spec: EngineRequest, on_abort: Callable[[], None] | None = None
    ) -> AsyncGenerator[Tokens, None]:
        """Yield the engine's tokens the moment they exist: each output alone while the caller
        keeps up, and the outputs that arrived while it was busy (writing the last message)
        merged; at most max_message_tokens a message (a longer output in several). While the
        server's loop is behind, a message waits the pacing's hold after the last (the first
        and the end never wait).
        Closing or cancelling the iterator before the end aborts the engine request, and calls
        on_abort once."""
        self.adapters.for_model(spec.model)  # an unknown name is NOT_FOUND before the engine
        inbox = Inbox(self._server_loop)
        producer = self._thread.submit(self._produce(spec, partial(self._handoff.post, inbox)))
        pending: deque[Item] = deque()
        not_before = 0.0  # the server loop's time the next message waits for
        try:
            while True:
                if not pending:
                    pending.extend(await inbox.take(not_before))
                merged: Tokens | None = None
                while pending and isinstance(pending[0], Tokens):
                    tokens = pending[0]
                    if merged is not None:
                        # One choice's consecutive outputs only (several choices interleave).
                        if (
                            tokens.choice != merged.choice
                            or len(merged.token_ids) + len(tokens.token_ids) > self._per_message
                        ):
                            break
                        merged.extend(tokens)
                    else:
                        merged = tokens
                    pending.popleft()
                if merged is not None:
                    # One engine output can hold hundreds of tokens (vLLM merges a request's
                    # outputs while its reader is behind): 145 KB in one message with 20
                    # logprobs a token, which the edge passes or holds whole.
                    if len(merged.token_ids) <= self._per_message:
                        yield merged
                    else:
                        for piece in merged.split(self._per_message):
                            yield piece
                    hold = self.pacing.hold
                    not_before = self._server_loop.time() + hold if hold else 0.0
                    continue
                end = pending.popleft()
                if isinstance(end, Exception):
                    raise end
                return  # None: the engine's end of the stream
        except (asyncio.CancelledError, GeneratorExit):
            await self.abort(spec.engine_ids)
            if on_abort is not None:
                on_abort()
            raise
        finally:
            producer.cancel()

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self._thread.call(self._llm.abort(request_ids))

    def close(self) -> None:
        """Shut the engine down (its processes end) and stop its thread; blocks."""

        async def shutdown() -> None:
            self._llm.shutdown()

        self._thread.submit(shutdown()).result()
        self._thread.stop()


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
