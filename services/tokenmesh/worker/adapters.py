"""The LoRA adapters a worker serves on its model (WorkerSettings.lora_modules): the name a
request gives in `model` picks one, and vLLM's engine answers with it (its LoRARequest).

Each adapter's id is its place in the settings (1, 2, ...): every front end of a worker, over
one engine, names an adapter by the same id (vLLM's own server counts them the same way, from
1, in `--lora-modules` order)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm.lora.request import LoRARequest

from tokenmesh.common.errors import NotFound
from tokenmesh.worker.config import WorkerSettings

# vLLM's max_lora_rank choices (vllm/config/lora.py).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_rank(directory: Path) -> int:
    """An adapter's rank (adapter_config.json's r, as vLLM's PEFTHelper reads it)."""
    config = json.loads((directory / "adapter_config.json").read_text())
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{directory}/adapter_config.json: r must be a positive integer")
    return rank


def lora_engine_args(settings: WorkerSettings) -> dict[str, Any]:
    """The engine arguments the adapters need: LoRA on, and (unless engine_args sets it) the
    smallest max_lora_rank vLLM allows that holds the largest adapter."""
    if not settings.lora_modules:
        return {}
    args: dict[str, Any] = {"enable_lora": True}
    if "max_lora_rank" not in settings.engine_args:
        largest = max(adapter_rank(path) for path in settings.lora_modules.values())
        fitting = [rank for rank in LORA_RANKS if rank >= largest]
        if not fitting:
            raise ValueError(f"lora_modules: rank {largest} is over vLLM's {LORA_RANKS[-1]}")
        args["max_lora_rank"] = fitting[0]
    return args


class Adapters:
    """The adapters by name, and the model they adapt."""

    def __init__(self, model: str, directories: Mapping[str, Path]) -> None:
        self.model = model
        self._requests = {
            name: LoRARequest(name, index, str(path), base_model_name=model)
            for index, (name, path) in enumerate(directories.items(), start=1)
        }

    @classmethod
    def of(cls, settings: WorkerSettings) -> Adapters:
        return cls(settings.model_name, settings.lora_modules)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._requests)

    def for_model(self, model: str) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the model itself (or no name)."""
        if not model or model == self.model:
            return None
        found = self._requests.get(model)
        if found is None:
            served = ", ".join([self.model, *self._requests])
            raise NotFound(f"model: {model!r} is not served here; served: {served}")
        return found

    async def load(self, llm: Any) -> None:
        """Loads every adapter into the engine now (vLLM's add_lora), as `vllm serve` loads
        its --lora-modules: a missing or malformed adapter stops the worker, named."""
        for name, request in self._requests.items():
            try:
                await llm.add_lora(request)
            except Exception as error:
                raise RuntimeError(
                    f"lora_modules.{name}: vLLM could not load {request.lora_path}: {error}"
                ) from error
