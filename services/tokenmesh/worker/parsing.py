"""Tool calls and reasoning found in a conversation's output by vLLM's own parsers.

The worker's settings name the parsers as `vllm serve`'s flags do (tool_call_parser,
enable_auto_tool_choice, reasoning_parser); vLLM's ParserManager composes them into one Parser,
whose adjust_request makes "required" and named functions structured outputs (the schema of
the calls, or the model's own call format where xgrammar knows it) and whose parse_delta splits
each output of a choice into content, reasoning and tool-call pieces, as vLLM's chat
completions stream them. A whole answer is the same pieces gathered, so the two never differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
)
from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls
from vllm.parser import ParserManager
from vllm.parser.abstract_parser import DelegatingParser, Parser
from vllm.tool_parsers.abstract_tool_parser import ToolParser

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.v1 import token_pb2
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.outputs import Tokens, ToolCallPiece


class OutputParsers:
    """The model's parsers, per the worker's settings: which a request needs, checked and
    adjusted as vLLM's server does before it renders the request."""

    def __init__(self, settings: WorkerSettings, tokenizer: Any, model_config: Any) -> None:
        self._tokenizer = tokenizer
        self._model_config = model_config
        self._auto = settings.enable_auto_tool_choice
        reasoning = ParserManager.get_reasoning_parser(settings.reasoning_parser or None)
        if settings.tool_call_parser:
            # The named parser (its required and named calls as it defines them).
            tools = ParserManager.get_parser(
                tool_parser_name=settings.tool_call_parser,
                reasoning_parser_name=settings.reasoning_parser,
                enable_auto_tools=True,
                tool_strict_level=settings.tool_strict_level,
                model_name=settings.model,
                tokenizer=tokenizer,
            )
        else:
            # No parser named: "required" and named functions still hold for any model, by
            # vLLM's JSON tool-call path (its base ToolParser: the calls' JSON schema as the
            # structured output, its output read back as the calls). "auto" is refused.
            class _JsonToolCalls(DelegatingParser):
                reasoning_parser_cls = reasoning
                tool_parser_cls = ToolParser

            tools = _JsonToolCalls
        assert tools is not None
        self._tools: type[Parser] = tools
        self._reasoning_only = (
            ParserManager.get_parser(
                reasoning_parser_name=settings.reasoning_parser, tokenizer=tokenizer
            )
            if reasoning
            else None
        )

    def for_request(self, options: Any) -> RequestParsing | None:
        """The parsing of one request's choices, its options adjusted in place as vLLM's
        server adjusts them (structured output for forced calls, special tokens kept for the
        parser); None when nothing is parsed (a completion; a conversation without tools and
        without a reasoning parser: its text is the content as it is)."""
        if not isinstance(options, ChatCompletionRequest):
            return None
        calling = bool(options.tools) and options.tool_choice != "none"
        if calling and options.tool_choice == "auto" and not self._auto:
            raise InvalidArgument(
                "tool_choice",
                '"auto" needs a worker with enable_auto_tool_choice and tool_call_parser '
                "(vLLM's --enable-auto-tool-choice); "
                '"required" or a named function work with any model',
            )
        parser_cls = self._tools if calling else self._reasoning_only
        if parser_cls is None:
            return None
        parsing = RequestParsing(parser_cls, options, self._tokenizer, self._model_config)
        parsing.adjust()
        return parsing


@dataclass
class RequestParsing:
    """One request's parsers: one per choice (vLLM's are stateful), made on first use."""

    parser_cls: type[Parser]
    options: ChatCompletionRequest
    tokenizer: Any
    model_config: Any
    parsers: dict[int, Parser] = field(default_factory=dict)
    # The choices that called a tool.
    called: set[int] = field(default_factory=set)

    def _parser(self, choice: int) -> Parser:
        parser = self.parsers.get(choice)
        if parser is None:
            tools: Any = self.options.tools
            parser = self.parsers[choice] = self.parser_cls(
                self.tokenizer, tools, model_config=self.model_config
            )
        return parser

    def adjust(self) -> None:
        self.options = self._parser(0).adjust_request(self.options)  # type: ignore[assignment]

    @property
    def named(self) -> bool:
        return isinstance(self.options.tool_choice, ChatCompletionNamedToolChoiceParam)

    def parse(self, tokens: Tokens, prompt_token_ids: Sequence[int]) -> None:
        """Split one output of a choice into its content (tokens.text), reasoning and
        tool-call pieces; a choice that called a tool (not a named one) ends with
        FINISH_REASON_TOOL_CALLS, as vLLM's server ends it."""
        finished = tokens.finish_reason != token_pb2.FINISH_REASON_UNSPECIFIED
        delta = self._parser(tokens.choice).parse_delta(
            tokens.text,
            list(tokens.token_ids),
            self.options,
            list(prompt_token_ids),
            finished=finished,
        )
        # The text now differs from the tokens' own: it counts with the last token.
        tokens.text_lengths = None
        if delta is not None:
            delta = maybe_filter_parallel_tool_calls(delta, self.options)
        tokens.text = (delta.content if delta is not None else None) or ""
        tokens.reasoning = (delta.reasoning if delta is not None else None) or ""
        if delta is not None and delta.tool_calls:
            self.called.add(tokens.choice)
            tokens.tool_calls = [
                ToolCallPiece(
                    call.index,
                    call.id or "",
                    (call.function.name or "") if call.function else "",
                    (call.function.arguments or "") if call.function else "",
                )
                for call in delta.tool_calls
            ]
        if (
            tokens.finish_reason == token_pb2.FINISH_REASON_STOP
            and tokens.choice in self.called
            and not self.named
        ):
            tokens.finish_reason = token_pb2.FINISH_REASON_TOOL_CALLS
