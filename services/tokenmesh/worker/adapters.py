"""The LoRA adapters a worker serves on its model (WorkerSettings.lora_modules): the name a
request gives in `model` picks one, and vLLM's engine answers with it (its LoRARequest).

Each adapter's id is its place in the settings (1, 2, ...): every front end of a worker, over
one engine, names an adapter by the same id (vLLM's own server counts them the same way, from
1, in `--lora-modules` order).

An adapter is loaded where it is used: at start the engine gets as many as its CPU cache holds
(max_cpu_loras), in settings order, and any other the first time a request names it; vLLM's
cache then evicts its least recently used adapter. The engine's own list of the adapters it
holds (list_loras, one answer for every front end) decides whether a request loads one, so the
loads, evictions and load times the worker counts are the engine's, whichever front end asked.

At run time (the worker's WorkerAdmin, decision 0034) an adapter can be added (the next id:
ids are never reused, vLLM caches by id), unloaded from the engine (still served: the next
request loads it again, unless load_on_use is off) or forgotten (no longer served).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from vllm.lora.request import LoRARequest

from tokenmesh.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
)
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


# Loading an adapter reads its weights from disk and builds its tensors: milliseconds for a
# small one on local disk, seconds for a large one on network storage.
LOAD_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class AdapterMetrics:
    """What loading adapters costs the engine, by adapter."""

    loads: Counter
    evictions: Counter
    load_seconds: Histogram

    @classmethod
    def register(cls, registry: CollectorRegistry) -> AdapterMetrics:
        return cls(
            Counter(
                "tokenmesh_worker_adapter_loads",
                "LoRA adapters loaded into the engine (at start, or for the first request that "
                "named one the engine did not hold), by adapter.",
                ["adapter"],
                registry=registry,
            ),
            Counter(
                "tokenmesh_worker_adapter_evictions",
                "LoRA adapters the engine dropped from its cache (max_cpu_loras) to load "
                "another, by the adapter dropped.",
                ["adapter"],
                registry=registry,
            ),
            Histogram(
                "tokenmesh_worker_adapter_load_seconds",
                "Seconds a LoRA adapter took to load into the engine, by adapter.",
                ["adapter"],
                buckets=LOAD_SECONDS_BUCKETS,
                registry=registry,
            ),
        )


class Adapters:
    """The adapters by name, the model they adapt, and which of them the engine holds."""

    def __init__(
        self,
        model: str,
        directories: Mapping[str, Path],
        metrics: AdapterMetrics | None = None,
        load_on_use: bool = True,
    ) -> None:
        self.model = model
        # Replaced, never changed in place: the server's loop reads them while the engine's
        # loop adds or forgets adapters.
        self._requests = {
            name: LoRARequest(name, index, str(path), base_model_name=model)
            for index, (name, path) in enumerate(directories.items(), start=1)
        }
        self._names = {request.lora_int_id: name for name, request in self._requests.items()}
        self._next_id = len(self._requests) + 1
        self._metrics = metrics
        self._load_on_use = load_on_use
        # The engine's LoRA limit (vLLM's max_lora_rank) once it has started with LoRA on;
        # None: LoRA off, no adapter can be added.
        self.max_rank: int | None = None
        # Loads under way on the engine's loop, by adapter id: requests for the same adapter
        # meanwhile wait for that one load.
        self._loading: dict[int, asyncio.Future[None]] = {}

    @classmethod
    def of(cls, settings: WorkerSettings, metrics: AdapterMetrics | None = None) -> Adapters:
        return cls(
            settings.model_name, settings.lora_modules, metrics, settings.adapter_load_on_use
        )

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

    async def held(self, llm: Any) -> tuple[str, ...]:
        """The adapters the engine holds now, in settings order."""
        ids = set(await llm.list_loras())
        return tuple(name for id_, name in self._names.items() if id_ in ids)

    async def load(self, llm: Any, capacity: int) -> None:
        """At start: loads the first `capacity` adapters (the engine's max_cpu_loras) into the
        engine now (vLLM's add_lora), as `vllm serve` loads its --lora-modules; a missing or
        malformed one stops the worker, named. The others load on first use."""
        for request in list(self._requests.values())[:capacity]:
            try:
                await self._add(llm, request, set())
            except Exception as error:
                raise RuntimeError(
                    f"lora_modules.{request.lora_name}: vLLM could not load "
                    f"{request.lora_path}: {error}"
                ) from error

    async def ensure(self, llm: Any, model: str) -> LoRARequest | None:
        """The adapter a request's `model` names, held by the engine once this returns (loaded
        now if it was not); None for the model itself. Runs on the engine's loop."""
        request = self.for_model(model)
        if request is None:
            return None
        await self._make_held(llm, request, on_use=True)
        return request

    async def _make_held(self, llm: Any, request: LoRARequest, on_use: bool) -> None:
        """The adapter held by the engine once this returns: loaded now unless the engine's
        own list has it. A request's use (on_use) loads it only with load_on_use."""
        held = set(await llm.list_loras())
        if request.lora_int_id in held:
            return
        if on_use and not self._load_on_use:
            raise FailedPrecondition(
                f"model: adapter {request.lora_name!r} is not loaded on this worker, and "
                "adapter_load_on_use is off: load it through the admin API "
                "(tokenmesh.v1.AdapterAdmin/LoadAdapter)"
            )
        await self._load(llm, request, held)

    async def _load(self, llm: Any, request: LoRARequest, held: set[int]) -> None:
        """Loads one adapter the engine does not hold, or waits for its load under way."""
        loading = self._loading.get(request.lora_int_id)
        if loading is not None:
            await asyncio.shield(loading)
            return
        done = asyncio.get_running_loop().create_future()
        self._loading[request.lora_int_id] = done
        try:
            await self._add(llm, request, held)
        except Exception as error:
            # Not the caller's to fix, nor to retry: the adapter's files on this worker.
            failed = Internal(
                f"model: adapter {request.lora_name!r} could not be loaded from "
                f"{request.lora_path}: {error}"
            )
            done.set_exception(failed)
            done.exception()  # retrieved here: a waiter, if any, raises it too
            raise failed from error
        else:
            done.set_result(None)
        finally:
            del self._loading[request.lora_int_id]

    async def _add(self, llm: Any, request: LoRARequest, held: set[int]) -> None:
        """Loads one adapter and counts what it cost: the load, its time, and the adapters the
        engine's cache dropped for it (held: the ones it held before)."""
        begun = time.perf_counter()
        added = await llm.add_lora(request)
        seconds = time.perf_counter() - begun
        if not added or self._metrics is None:
            return  # another front end loaded it first (vLLM's add_lora says False)
        self._metrics.loads.labels(request.lora_name).inc()
        self._metrics.load_seconds.labels(request.lora_name).observe(seconds)
        if held:
            for dropped in held - set(await llm.list_loras()):
                if dropped in self._names:
                    self._metrics.evictions.labels(self._names[dropped]).inc()

    def _check_new(self, name: str, directory: Path) -> int:
        """An adapter that may be added (its rank, in adapter_config.json), or the error
        naming the field and the limit."""
        if self.max_rank is None:
            raise FailedPrecondition(
                "this worker's engine has LoRA off: start it with adapters (lora_modules) or "
                'with TOKENMESH_WORKER_ENGINE_ARGS=\'{"enable_lora": true, "max_lora_rank": '
                "<the largest rank to serve>}'"
            )
        if not name.strip() or name != name.strip():
            raise InvalidArgument("name", f"{name!r} is not an adapter name (empty or spaced)")
        if name == self.model:
            raise AlreadyExists(f"name: {name!r} is the model's own name, not an adapter's")
        if not directory.is_absolute():
            raise InvalidArgument("directory", f"{directory} is not an absolute path")
        if not (directory / "adapter_config.json").is_file():
            raise InvalidArgument(
                "directory",
                f"{directory} has no adapter_config.json on this worker (a PEFT LoRA "
                "adapter's directory)",
            )
        try:
            rank = adapter_rank(directory)
        except ValueError as error:
            raise InvalidArgument("directory", str(error)) from None
        if rank > self.max_rank:
            raise InvalidArgument(
                "directory",
                f"the adapter's rank {rank} is over the engine's max_lora_rank {self.max_rank} "
                "(TOKENMESH_WORKER_ENGINE_ARGS max_lora_rank, set as the worker starts)",
            )
        return rank

    async def add(self, llm: Any, name: str, directory: Path) -> tuple[LoRARequest, bool]:
        """Serves an adapter from now on and loads it into the engine (the load counted as
        any other). The same name and directory again: it is made held, nothing else
        changes. Returns it and whether it is new. Runs on the engine's loop."""
        known = self._requests.get(name)
        if known is not None:
            if Path(known.lora_path) != directory:
                raise AlreadyExists(
                    f"name: adapter {name!r} is already served from {known.lora_path}, not "
                    f"{directory}: forget it first"
                )
            await self._make_held(llm, known, on_use=False)
            return known, False
        self._check_new(name, directory)
        request = LoRARequest(name, self._next_id, str(directory), base_model_name=self.model)
        self._next_id += 1
        # Served (and so named in the metrics) from the load on; forgotten again if it fails.
        self._requests = {**self._requests, name: request}
        self._names = {**self._names, request.lora_int_id: name}
        try:
            await self._make_held(llm, request, on_use=False)
        except BaseException:
            self._drop(request)
            raise
        return request, True

    async def unload(self, llm: Any, name: str) -> bool:
        """Drops an adapter from the engine's cache (vLLM's remove_lora); still served. True
        if the engine held it. Runs on the engine's loop."""
        request = self._served(name)
        return bool(await llm.remove_lora(request.lora_int_id))

    async def forget(self, llm: Any, name: str) -> bool:
        """Stops serving an adapter (NOT_FOUND from now on) and drops it from the engine; its
        id is not given to another. True if the engine held it. Runs on the engine's loop."""
        request = self._served(name)
        self._drop(request)
        return bool(await llm.remove_lora(request.lora_int_id))

    def _served(self, name: str) -> LoRARequest:
        request = self._requests.get(name)
        if request is None:
            served = ", ".join(self._requests) or "none"
            raise NotFound(f"name: adapter {name!r} is not served here; adapters: {served}")
        return request

    def _drop(self, request: LoRARequest) -> None:
        self._requests = {
            name: known for name, known in self._requests.items() if known is not request
        }
        self._names = {id_: name for id_, name in self._names.items() if name in self._requests}
