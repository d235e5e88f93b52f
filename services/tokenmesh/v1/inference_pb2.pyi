from google.api import httpbody_pb2 as _httpbody_pb2
from tokenmesh.v1 import token_pb2 as _token_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "messages", "tools", "add_special_tokens", "add_generation_prompt", "return_token_strs")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ConversationMessage]
    tools: ToolCalling
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ConversationMessage, _Mapping]]] = ..., tools: _Optional[_Union[ToolCalling, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ..., return_token_strs: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens", "max_model_len", "token_strs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., token_strs: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("prompt",)
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    def __init__(self, prompt: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "logprobs", "top_logprobs", "stream_interval", "max_tokens_within_context", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "stop_token_ids", "bad_words", "allowed_token_ids", "logit_bias", "include_stop_str_in_output", "structured_outputs", "n", "echo", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_WITHIN_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    stream_interval: int
    max_tokens_within_context: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias: _containers.ScalarMap[int, float]
    include_stop_str_in_output: bool
    structured_outputs: _token_pb2.StructuredOutputs
    n: int
    echo: bool
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., stream_interval: _Optional[int] = ..., max_tokens_within_context: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., include_stop_str_in_output: _Optional[bool] = ..., structured_outputs: _Optional[_Union[_token_pb2.StructuredOutputs, _Mapping]] = ..., n: _Optional[int] = ..., echo: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class InferenceRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling", "warnings", "messages", "openai", "degraded", "tools", "prompts", "prompt_token_ids", "resume", "delivered_messages", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    OPENAI_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    sampling: SamplingParams
    warnings: _containers.RepeatedScalarFieldContainer[str]
    messages: _containers.RepeatedCompositeFieldContainer[ConversationMessage]
    openai: OpenAIAnswer
    degraded: str
    tools: ToolCalling
    prompts: _containers.RepeatedCompositeFieldContainer[PromptInput]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume: Resumption
    delivered_messages: _containers.RepeatedScalarFieldContainer[bytes]
    model: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., warnings: _Optional[_Iterable[str]] = ..., messages: _Optional[_Iterable[_Union[ConversationMessage, _Mapping]]] = ..., openai: _Optional[_Union[OpenAIAnswer, _Mapping]] = ..., degraded: _Optional[str] = ..., tools: _Optional[_Union[ToolCalling, _Mapping]] = ..., prompts: _Optional[_Iterable[_Union[PromptInput, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., resume: _Optional[_Union[Resumption, _Mapping]] = ..., delivered_messages: _Optional[_Iterable[bytes]] = ..., model: _Optional[str] = ...) -> None: ...

class Resumption(_message.Message):
    __slots__ = ("choices", "attempt")
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedCompositeFieldContainer[DeliveredChoice]
    attempt: int
    def __init__(self, choices: _Optional[_Iterable[_Union[DeliveredChoice, _Mapping]]] = ..., attempt: _Optional[int] = ...) -> None: ...

class DeliveredChoice(_message.Message):
    __slots__ = ("choice", "token_ids", "finished")
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    choice: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    def __init__(self, choice: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ...) -> None: ...

class PromptInput(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ToolCalling(_message.Message):
    __slots__ = ("tools_json", "tool_choice_json", "parallel_tool_calls")
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_JSON_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    tools_json: str
    tool_choice_json: str
    parallel_tool_calls: bool
    def __init__(self, tools_json: _Optional[str] = ..., tool_choice_json: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ...) -> None: ...

class OpenAIAnswer(_message.Message):
    __slots__ = ("chat", "id", "created", "model", "stream", "include_usage", "time_limit_seconds", "relayed")
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_USAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    chat: bool
    id: str
    created: int
    model: str
    stream: bool
    include_usage: bool
    time_limit_seconds: float
    relayed: bool
    def __init__(self, chat: _Optional[bool] = ..., id: _Optional[str] = ..., created: _Optional[int] = ..., model: _Optional[str] = ..., stream: _Optional[bool] = ..., include_usage: _Optional[bool] = ..., time_limit_seconds: _Optional[float] = ..., relayed: _Optional[bool] = ...) -> None: ...

class RelayedPart(_message.Message):
    __slots__ = ("content_type", "data", "token")
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    content_type: str
    data: bytes
    token: _token_pb2.Token
    def __init__(self, content_type: _Optional[str] = ..., data: _Optional[bytes] = ..., token: _Optional[_Union[_token_pb2.Token, _Mapping]] = ...) -> None: ...

class ConversationMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[_token_pb2.ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[_token_pb2.ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class EngineStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "kv_cache_usage", "reported_unix_nanos", "model", "max_model_len", "prefix_cache_queries", "prefix_cache_hits", "adapters", "held_adapters")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    REPORTED_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    HELD_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    kv_cache_usage: float
    reported_unix_nanos: int
    model: str
    max_model_len: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    adapters: _containers.RepeatedScalarFieldContainer[str]
    held_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., reported_unix_nanos: _Optional[int] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., adapters: _Optional[_Iterable[str]] = ..., held_adapters: _Optional[_Iterable[str]] = ...) -> None: ...
