"""Worker settings, from TOKENMESH_WORKER_* environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from tokenmesh.common.cpu_pinning import known_cores
from tokenmesh.common.pools import pool_names
from tokenmesh.common.sampling import SamplingLimits, ToolLimits
from tokenmesh.common.settings import ServiceSettings


class WorkerSettings(ServiceSettings, SamplingLimits, ToolLimits):
    model_config = SettingsConfigDict(env_prefix="TOKENMESH_WORKER_", frozen=True, extra="ignore")

    port: int = Field(default=50061, ge=0, le=65535)
    metrics_port: int = Field(default=9461, ge=-1, le=65535)

    model: str = Field(
        default="models/tiny-llama",
        description=(
            "A Hugging Face model directory or hub id. The default is the tiny Llama `make "
            "setup` generates, so nothing is downloaded at run time."
        ),
    )
    served_model_name: str | None = Field(
        default=None, description="Name reported in stats and logs; defaults to the model path."
    )
    lora_modules: dict[str, Path] = Field(
        default_factory=dict,
        description=(
            "LoRA adapters of the model the worker serves, as a JSON object {name: directory} "
            "(PEFT's adapter_config.json and weights, as `vllm serve --lora-modules` takes "
            "them): a request naming one as its `model` is answered with it. As many as the "
            "engine holds (max_cpu_loras) load as the worker starts, in this order (a bad one "
            "stops it, named); any other on first use, the engine then dropping its least "
            "recently used (decision 0033). Non-empty turns vLLM's enable_lora on and, unless "
            "engine_args sets it, max_lora_rank to fit the largest adapter; max_loras "
            "(adapters in one batch, vLLM's default 1) and max_cpu_loras (adapters held, "
            "default max_loras) are engine_args. A worker with LoRA on refuses prompt "
            "logprobs (prompt_logprobs, echo with logprobs): vLLM's engine fails them "
            "(decision 0032)."
        ),
    )
    pool: str = Field(
        default="",
        description=(
            "The worker pool it belongs to (MeshSettings.worker_pools; empty: the default "
            "pool): with Consul it registers as the pool's Envoy cluster, worker-<pool> "
            "(worker for the default pool), with a pool tag, so the control plane's discovery "
            "places it in its pool (consul_services names worker-<pool>)."
        ),
    )
    adapter_load_on_use: bool = Field(
        default=True,
        description=(
            "A request naming an adapter the engine does not hold loads it (the engine then "
            "dropping its least recently used). Off: such a request is FAILED_PRECONDITION "
            "naming the adapter; adapters are loaded only as the worker starts and through the "
            "admin API (tokenmesh.v1.AdapterAdmin, decision 0034). A worker with LoRA on and "
            "no lora_modules (engine_args enable_lora and max_lora_rank) serves only the "
            "adapters the admin API adds."
        ),
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto",
        description=(
            "Weights/activations dtype: auto (from the model config), bfloat16, float16, float32."
        ),
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        description=(
            "Context length (prompt + generated tokens), at most the model's own. Unset: the "
            "model's own, as `vllm serve` (vLLM's --max-model-len)."
        ),
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Sequences the engine batches at once (continuous batching); more wait in its "
            "queue. Unset: vLLM's default for the hardware, as `vllm serve` picks it (vLLM's "
            "--max-num-seqs)."
        ),
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Any of vLLM's engine arguments, by the names `vllm serve --help` gives them "
            '(underscores or dashes), as a JSON object: e.g. {"kv_cache_dtype": "fp8", '
            '"max_num_batched_tokens": 8192, "speculative_config": {...}}. The engine\'s own '
            "parser checks them as the worker starts: an unknown name or a bad value stops "
            "it at once, naming the argument. One that is also a setting here (model, dtype, "
            "max_model_len, max_num_seqs, ...) must agree with the setting."
        ),
    )
    max_waiting_requests: int = Field(
        default=256,
        ge=0,
        description=(
            "Streams that may wait for a place in the batch (beyond max_num_seqs running); "
            "more are refused at once with RESOURCE_EXHAUSTED, instead of queueing until "
            "their deadlines pass."
        ),
    )
    kv_cache_space_gib: int = Field(
        default=1,
        ge=1,
        description="CPU only: KV-cache size in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE).",
    )
    cpu_threads_bind: str = Field(
        default="auto",
        description=(
            'CPU only: cores vLLM\'s OpenMP threads bind to, e.g. "0-1", "1", or "auto". Two '
            "workers on one machine need disjoint sets (vLLM's VLLM_CPU_OMP_THREADS_BIND)."
        ),
    )
    engine_affinity: str = Field(
        default="runner",
        description=(
            "CPU only: cores vLLM's engine core process runs on (it schedules each step, then "
            'busy-waits for the model runner): "runner", the cores the runner is bound to '
            '(cpu_threads_bind), for machines with no core to spare; a core list such as "7", a '
            'core of its own; or "any", where it starts (every core, the mesh\'s included).'
        ),
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description=(
            "GPU only: fraction of GPU memory vLLM may use for weights, activations and KV cache."
        ),
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs a model is sharded over.")
    trust_remote_code: bool = Field(
        default=False,
        description=(
            "Run model code shipped inside the model repository (needed by some architectures)."
        ),
    )

    max_prompt_bytes: int = Field(
        default=256 * 1024, ge=1, description="Request limit: `prompt` 1..this many bytes."
    )
    max_messages: int = Field(
        default=64,
        ge=1,
        description=(
            "Request limit: `messages` (a conversation rendered with the model's chat "
            "template) at most this many; each message's content, and all of them together, "
            "at most `max_prompt_bytes`."
        ),
    )
    max_request_id_chars: int = Field(
        default=128, ge=1, description="Request limit: `request_id` at most this many characters."
    )
    max_warnings: int = Field(
        default=8, ge=0, description="Warnings a request may ask to have sent on its first token."
    )
    max_warning_bytes: int = Field(
        default=1024, ge=1, description="The size of each of those warnings, in bytes."
    )
    stream_interval: int = Field(
        default=1,
        ge=1,
        description=(
            "Tokens per message: every stream's messages hold at least this many (vLLM's "
            "--stream-interval; 1: each token the moment it exists)."
        ),
    )
    structured_outputs_backend: Literal[
        "auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"
    ] = Field(
        default="auto",
        description=(
            "The structured-output backend (vLLM's --structured-outputs-config backend): auto "
            "lets vLLM choose per request."
        ),
    )
    structured_outputs_disable_any_whitespace: bool = Field(
        default=False,
        description=(
            "JSON answers (json schemas, json_object) without whitespace between tokens "
            "(vLLM's --structured-outputs-config disable_any_whitespace; xgrammar and guidance "
            "only). The local mesh turns it on: its random tiny model otherwise fills answers "
            "with whitespace until max_tokens."
        ),
    )

    tool_call_parser: str | None = Field(
        default=None,
        description=(
            "How the model writes tool calls (vLLM's --tool-call-parser: hermes, llama3_json, "
            "mistral, ...). Unset: requests whose tool_choice is not none are refused. The "
            "local mesh's tiny model writes Hermes' <tool_call> tags."
        ),
    )
    enable_auto_tool_choice: bool = Field(
        default=False,
        description=(
            'tool_choice "auto": the model decides whether to call, its calls found in its '
            "text by tool_call_parser (vLLM's --enable-auto-tool-choice). Off: only "
            '"required" and named functions, which structured output enforces.'
        ),
    )
    tool_strict_level: Literal["auto", "function", "parameter"] = Field(
        default="auto",
        description=(
            "How far structured output binds tool calls (vLLM's --tool-strict-level): auto, "
            'the calls "required" or a named function force, and the arguments of functions '
            "marked \"strict\"; function, every call's envelope; parameter, every call's "
            "arguments to its function's parameters as well."
        ),
    )
    enforce_strict_tool_calling: bool = Field(
        default=True,
        description=(
            'Forced calls ("required", a named function) in the model\'s own call format, '
            "bound by an xgrammar structural tag where the parser has one (vLLM's "
            "VLLM_ENFORCE_STRICT_TOOL_CALLING). Off: bound by the calls' JSON schema, which "
            "structured_outputs_disable_any_whitespace makes compact (structural tags ignore "
            "it); the local mesh's random tiny model needs that."
        ),
    )
    reasoning_parser: str = Field(
        default="",
        description=(
            "How the model marks its reasoning (vLLM's --reasoning-parser: deepseek_r1, "
            "qwen3, ...): conversations' answers then carry it apart from the content "
            '(OpenAI\'s "reasoning_content", Token.reasoning). Empty: none.'
        ),
    )

    # Engine arguments the typed settings give (engine argument: setting).
    ENGINE_SHORTCUTS: ClassVar[dict[str, str]] = {
        "model": "model",
        "served_model_name": "served_model_name",
        "dtype": "dtype",
        "max_model_len": "max_model_len",
        "max_num_seqs": "max_num_seqs",
        "gpu_memory_utilization": "gpu_memory_utilization",
        "tensor_parallel_size": "tensor_parallel_size",
        "trust_remote_code": "trust_remote_code",
        "max_logprobs": "max_top_logprobs",
        "stream_interval": "stream_interval",
    }
    # Engine arguments the worker sets itself, and why.
    ENGINE_OWN: ClassVar[dict[str, str]] = {
        "enable_log_requests": "prompts never reach the logs (docs/security.md)",
        "enable_log_outputs": "answers never reach the logs (docs/security.md)",
        "disable_log_stats": "the worker's load reports and stall watchdog read the engine's stats",
        "structured_outputs_config": (
            "set structured_outputs_backend and structured_outputs_disable_any_whitespace"
        ),
    }

    @model_validator(mode="before")
    @classmethod
    def _engine_args_fill_unset_shortcuts(cls, data: Any) -> Any:
        """A shortcut left unset takes the engine argument's value (its name normalised)."""
        if not isinstance(data, dict) or not isinstance(data.get("engine_args"), dict):
            return data
        args = {name.replace("-", "_"): value for name, value in data["engine_args"].items()}
        data = {**data, "engine_args": args}
        for name, setting in cls.ENGINE_SHORTCUTS.items():
            if name in args and data.get(setting) is None:
                value = args[name]
                if name == "served_model_name" and isinstance(value, list) and len(value) == 1:
                    value = value[0]
                data[setting] = value
        return data

    @model_validator(mode="after")
    def _one_engine_under_several_front_ends(self) -> WorkerSettings:
        parallel = self.engine_args.get("data_parallel_size", 1)
        if self.frontends > 1 and parallel not in (None, 1):
            raise ValueError(
                f"frontends={self.frontends} with engine_args.data_parallel_size={parallel}: "
                "several front ends share one engine; run one worker per data-parallel rank"
            )
        return self

    @model_validator(mode="after")
    def _engine_args_agree_with_the_settings(self) -> WorkerSettings:
        for name, value in self.engine_args.items():
            if name in self.ENGINE_OWN:
                raise ValueError(f"engine_args.{name}: set by the worker: {self.ENGINE_OWN[name]}")
            setting = self.ENGINE_SHORTCUTS.get(name)
            if setting is None:
                continue
            if name == "served_model_name" and isinstance(value, list) and len(value) == 1:
                value = value[0]
            try:
                value = TypeAdapter(
                    type(self).model_fields[setting].annotation or Any
                ).validate_python(value)
            except ValidationError as error:
                reason = error.errors()[0]["msg"]
                raise ValueError(f"engine_args.{name}: {reason}") from None
            if value != getattr(self, setting):
                raise ValueError(
                    f"engine_args.{name} is {value!r} but the setting {setting} is "
                    f"{getattr(self, setting)!r}: set one of them"
                )
        return self

    @model_validator(mode="after")
    def _whitespace_needs_a_backend_that_has_it(self) -> WorkerSettings:
        # vLLM refuses the combination when the engine starts; here it is named at once.
        if (
            self.structured_outputs_disable_any_whitespace
            and self.structured_outputs_backend
            not in (
                "xgrammar",
                "guidance",
            )
        ):
            raise ValueError(
                "structured_outputs_disable_any_whitespace needs structured_outputs_backend "
                f"xgrammar or guidance, not {self.structured_outputs_backend}"
            )
        return self

    @model_validator(mode="after")
    def _adapters_are_named_apart_from_the_model(self) -> WorkerSettings:
        for name, directory in self.lora_modules.items():
            if not name.strip() or name != name.strip():
                raise ValueError(f"lora_modules: {name!r} is not a name (empty or spaced)")
            if name in (self.model_name, self.model):
                raise ValueError(f"lora_modules.{name}: the model's own name, not an adapter's")
            if not (directory / "adapter_config.json").is_file():
                raise ValueError(
                    f"lora_modules.{name}: {directory} has no adapter_config.json (a PEFT "
                    "LoRA adapter's directory)"
                )
        if self.lora_modules and self.engine_args.get("enable_lora") is False:
            raise ValueError("lora_modules needs LoRA: engine_args.enable_lora is false")
        return self

    @model_validator(mode="after")
    def _auto_tool_choice_needs_a_parser(self) -> WorkerSettings:
        # vLLM's server refuses the flag without a parser; named here as the worker starts.
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser")
        return self

    max_message_tokens: int = Field(
        default=64,
        ge=1,
        description=(
            "Engine outputs that arrive while a stream's last message is still being written "
            "go out together, at most this many tokens a message (an engine output of more, "
            "which vLLM makes while its reader is behind, goes out in several)."
        ),
    )
    stream_hold_max_ms: float = Field(
        default=50,
        ge=0,
        description=(
            "While the server loop is behind (stream_hold_lag_ms), each stream sends at most "
            "one message per hold, up to this many ms: its later tokens gather, its first and "
            "its end go at once (decision 0039). 0: every output goes the moment it exists."
        ),
    )
    stream_hold_lag_ms: float = Field(
        default=2,
        gt=0,
        description=(
            "The server loop's mean lag in taking the engine's outputs above which the hold "
            "doubles each 50 ms; under half of it the hold shrinks, to 0."
        ),
    )
    default_temperature: float = Field(
        default=1.0, ge=0, le=2, description="Temperature when a request leaves it unset."
    )

    engine_check_interval_seconds: float = Field(
        default=1.0,
        gt=0,
        description=(
            "How often the worker checks that the engine process is alive (a dead engine "
            "turns the worker NOT_SERVING and exits it non-zero so its supervisor restarts "
            "it) and moving (engine_stall_seconds)."
        ),
    )
    handover_address: str = Field(
        default="",
        description=(
            "Where this worker reaches the other workers (Envoy's worker listener, as the "
            "gateways do) to hand its streams over when its engine dies: each continues on "
            "another worker from the token where it stopped (empty: the streams end "
            "UNAVAILABLE)."
        ),
    )
    handover_tls_ca_file: Path | None = Field(
        default=None,
        description=(
            "TLS to handover_address (Envoy's internal listener with internal TLS on): the PEM "
            "CA that signed its certificate, which must name the address's host. Unset: "
            "plaintext."
        ),
    )
    max_resumptions: int = Field(
        default=2,
        ge=0,
        le=16,
        description=(
            "A stream moves to another worker at most this many times in all (the gateways' "
            "max_resumptions, counted on together): a handed-over stream already moved that "
            "often ends with the engine's error."
        ),
    )
    handover_seconds: float = Field(
        default=600.0,
        ge=0,
        description=(
            "Once its engine died, the worker (NOT_SERVING) waits at most this long for the "
            "streams it hands over to finish, then stops (exit 1, restarted by its supervisor); "
            "each stream is also bounded by its own deadline."
        ),
    )
    engine_stall_seconds: float = Field(
        default=60.0,
        gt=0,
        description=(
            "A hung engine (alive, but no step): while the engine holds requests and has "
            "finished no engine step for this long, the worker turns NOT_SERVING (Envoy stops "
            "sending it streams, Kubernetes' liveness probe restarts it) and logs an error; "
            "SERVING again once a step completes. A healthy engine, however saturated, "
            "finishes a step (a decode of its batch, or one chunk of a long prefill) in far "
            "less; checked every engine_check_interval_seconds."
        ),
    )

    frontends: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "Front-end processes over the one engine, as `vllm serve --api-server-count`: each "
            "serves the gRPC port (shared, SO_REUSEPORT; the kernel spreads connections, not "
            "streams, over them, and Envoy opens one per its worker_streams_per_connection) "
            "and turns the engine's outputs into messages, so the engine is not held back by "
            "one process's core. 1: the engine's client runs in the worker's own "
            "process. More: a supervisor process starts the engine and the front ends, serves "
            "the metrics port (every front end's series, labelled frontend), and ends them all "
            "together (docs/decisions/0026-several-front-ends-over-one-engine.md)."
        ),
    )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @field_validator("pool")
    @classmethod
    def _pool_name(cls, pool: str) -> str:
        return pool_names([pool])[0] if pool else pool

    @field_validator("engine_affinity")
    @classmethod
    def _engine_cores(cls, value: str) -> str:
        if value in ("runner", "any"):
            return value
        try:
            cores = known_cores(value)
        except ValueError as error:
            raise ValueError(f'"runner", "any" or a core list such as "7": {error}') from None
        if not cores:
            raise ValueError('"runner", "any" or a core list such as "7", not an empty one')
        return value
