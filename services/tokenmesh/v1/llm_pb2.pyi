from tokenmesh.v1 import token_pb2 as _token_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "max_tokens", "temperature", "documents", "top_k_documents", "top_p", "seed", "stop", "ignore_eos", "logprobs", "top_logprobs", "stream_interval", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "stop_token_ids", "bad_words", "allowed_token_ids", "logit_bias", "include_stop_str_in_output", "structured_outputs", "n", "echo", "prompt_logprobs", "model")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
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
    MODEL_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    max_tokens: int
    temperature: float
    documents: _containers.RepeatedScalarFieldContainer[str]
    top_k_documents: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    stream_interval: int
    top_k: int
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
    model: str
    def __init__(self, prompt: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., documents: _Optional[_Iterable[str]] = ..., top_k_documents: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., stream_interval: _Optional[int] = ..., top_k: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., include_stop_str_in_output: _Optional[bool] = ..., structured_outputs: _Optional[_Union[_token_pb2.StructuredOutputs, _Mapping]] = ..., n: _Optional[int] = ..., echo: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class Query(_message.Message):
    __slots__ = ("prompt", "max_tokens", "temperature", "documents", "top_k_documents", "top_p", "seed", "stop", "ignore_eos", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "stop_token_ids", "bad_words", "allowed_token_ids", "logit_bias", "include_stop_str_in_output", "structured_outputs", "n", "model")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
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
    MODEL_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    max_tokens: int
    temperature: float
    documents: _containers.RepeatedScalarFieldContainer[str]
    top_k_documents: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    top_k: int
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
    model: str
    def __init__(self, prompt: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., documents: _Optional[_Iterable[str]] = ..., top_k_documents: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., top_k: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., include_stop_str_in_output: _Optional[bool] = ..., structured_outputs: _Optional[_Union[_token_pb2.StructuredOutputs, _Mapping]] = ..., n: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class Answer(_message.Message):
    __slots__ = ("text", "finish_reason", "usage", "warnings", "used_document_indices", "choices")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    USED_DOCUMENT_INDICES_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    text: str
    finish_reason: _token_pb2.FinishReason
    usage: _token_pb2.Usage
    warnings: _containers.RepeatedScalarFieldContainer[str]
    used_document_indices: _containers.RepeatedScalarFieldContainer[int]
    choices: _containers.RepeatedCompositeFieldContainer[AnswerChoice]
    def __init__(self, text: _Optional[str] = ..., finish_reason: _Optional[_Union[_token_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_token_pb2.Usage, _Mapping]] = ..., warnings: _Optional[_Iterable[str]] = ..., used_document_indices: _Optional[_Iterable[int]] = ..., choices: _Optional[_Iterable[_Union[AnswerChoice, _Mapping]]] = ...) -> None: ...

class AnswerChoice(_message.Message):
    __slots__ = ("index", "text", "finish_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    finish_reason: _token_pb2.FinishReason
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_token_pb2.FinishReason, str]] = ...) -> None: ...

class DocumentChunk(_message.Message):
    __slots__ = ("text", "instruction", "max_tokens", "temperature")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    text: str
    instruction: str
    max_tokens: int
    temperature: float
    def __init__(self, text: _Optional[str] = ..., instruction: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("user", "cancel")
    USER_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    user: UserTurn
    cancel: CancelGeneration
    def __init__(self, user: _Optional[_Union[UserTurn, _Mapping]] = ..., cancel: _Optional[_Union[CancelGeneration, _Mapping]] = ...) -> None: ...

class UserTurn(_message.Message):
    __slots__ = ("content", "max_tokens", "temperature", "ignore_eos")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    content: str
    max_tokens: int
    temperature: float
    ignore_eos: bool
    def __init__(self, content: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class CancelGeneration(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChatEvent(_message.Message):
    __slots__ = ("turn", "token", "turn_end")
    TURN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TURN_END_FIELD_NUMBER: _ClassVar[int]
    turn: int
    token: _token_pb2.Token
    turn_end: TurnEnd
    def __init__(self, turn: _Optional[int] = ..., token: _Optional[_Union[_token_pb2.Token, _Mapping]] = ..., turn_end: _Optional[_Union[TurnEnd, _Mapping]] = ...) -> None: ...

class TurnEnd(_message.Message):
    __slots__ = ("finish_reason", "usage", "dropped_turns")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TURNS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _token_pb2.FinishReason
    usage: _token_pb2.Usage
    dropped_turns: int
    def __init__(self, finish_reason: _Optional[_Union[_token_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_token_pb2.Usage, _Mapping]] = ..., dropped_turns: _Optional[int] = ...) -> None: ...
