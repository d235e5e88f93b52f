"""Worker settings, from TOKENMESH_WORKER_* environment variables."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from tokenmesh.common.settings import ServiceSettings


class WorkerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENMESH_WORKER_", frozen=True, extra="ignore")

    port: int = Field(default=50061, ge=0, le=65535)
    metrics_port: int = Field(default=9461, ge=-1, le=65535)

    # A Hugging Face model directory or hub id. The default is the tiny Llama `make setup`
    # generates, so nothing is downloaded at run time.
    model: str = "models/tiny-llama"
    # Name reported in stats and logs; defaults to the model path.
    served_model_name: str | None = None
    # Weights/activations dtype: auto (from the model config), bfloat16, float16, float32.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # Context length (prompt + generated tokens); caps the model's own maximum.
    max_model_len: int = Field(default=2048, ge=16)
    # Sequences the engine batches at once (continuous batching); more wait in its queue.
    max_num_seqs: int = Field(default=256, ge=1)
    # Streams that may wait for a place in the batch (beyond max_num_seqs running); more are
    # refused at once with RESOURCE_EXHAUSTED, instead of queueing until their deadlines pass.
    max_waiting_requests: int = Field(default=256, ge=0)
    # CPU only: KV-cache size in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE).
    kv_cache_space_gib: int = Field(default=1, ge=1)
    # CPU only: cores vLLM's OpenMP threads bind to, e.g. "0-1", "1", or "auto". Two workers
    # on one machine need disjoint sets (vLLM's VLLM_CPU_OMP_THREADS_BIND).
    cpu_threads_bind: str = "auto"
    # GPU only: fraction of GPU memory vLLM may use for weights, activations and KV cache.
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    # GPUs a model is sharded over.
    tensor_parallel_size: int = Field(default=1, ge=1)
    # Run model code shipped inside the model repository (needed by some architectures).
    trust_remote_code: bool = False

    # Request limits: anything past them is rejected with INVALID_ARGUMENT naming the limit.
    max_tokens_cap: int = Field(default=4096, ge=1)
    max_prompt_bytes: int = Field(default=256 * 1024, ge=1)
    max_stop_sequences: int = Field(default=8, ge=0)
    max_stop_sequence_bytes: int = Field(default=256, ge=1)
    max_request_id_chars: int = Field(default=128, ge=1)
    # Warnings a request may ask to have sent on its first token, and the size of each.
    max_warnings: int = Field(default=8, ge=0)
    max_warning_bytes: int = Field(default=1024, ge=1)
    # Alternatives per token a request may ask for (top_logprobs); also vLLM's max_logprobs.
    max_top_logprobs: int = Field(default=20, ge=0)
    # Tokens per message: every stream's messages hold at least this many (vLLM's
    # --stream-interval; 1: each token the moment it exists), and the most a request may ask for
    # (sampling.stream_interval).
    stream_interval: int = Field(default=1, ge=1)
    max_stream_interval: int = Field(default=64, ge=1)
    # Engine outputs that arrive while a stream's last message is still being written go out
    # together, at most this many tokens a message (one output is never split).
    max_message_tokens: int = Field(default=64, ge=1)
    # Temperature when a request leaves it unset.
    default_temperature: float = Field(default=1.0, ge=0, le=2)

    # How often the worker checks that the engine process is alive; a dead engine turns the
    # worker NOT_SERVING and exits it non-zero so its supervisor restarts it.
    engine_check_interval_seconds: float = Field(default=1.0, gt=0)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
