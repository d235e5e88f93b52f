"""The engine's arguments: the worker's typed settings (shortcuts) and TOKENMESH_WORKER_ENGINE_ARGS,
read by vLLM's own command-line parser, so every name, type and choice is checked as `vllm
serve` checks it, and every engine argument it has is reachable."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from tokenmesh.worker.adapters import lora_engine_args
from tokenmesh.worker.config import WorkerSettings


class EngineArgsError(ValueError):
    """An engine argument vLLM does not have or refuses: its name and why."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"engine argument {name}: {reason}")
        self.name = name


def shortcut_args(settings: WorkerSettings) -> dict[str, Any]:
    """The engine arguments the typed settings give (unset ones left to vLLM's defaults)."""
    named: dict[str, Any] = {
        "model": settings.model,
        "dtype": settings.dtype,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "trust_remote_code": settings.trust_remote_code,
        "max_logprobs": settings.max_top_logprobs,
        "stream_interval": settings.stream_interval,
        "structured_outputs_config": {
            "backend": settings.structured_outputs_backend,
            "disable_any_whitespace": settings.structured_outputs_disable_any_whitespace,
        },
        # vLLM's per-request log lines stay off (its default, stated here because prompts
        # must never reach the logs; docs/security.md, "No prompt text in logs").
        "enable_log_requests": False,
    }
    if settings.served_model_name is not None:
        named["served_model_name"] = [settings.served_model_name]
    if settings.max_model_len is not None:
        named["max_model_len"] = settings.max_model_len
    if settings.max_num_seqs is not None:
        named["max_num_seqs"] = settings.max_num_seqs
    named.update(lora_engine_args(settings))
    return named


def engine_args(settings: WorkerSettings) -> AsyncEngineArgs:
    """The settings' engine arguments and ENGINE_ARGS' others (the settings checked that those
    naming a setting agree with it), parsed as `vllm serve` parses its flags."""
    fields = {
        **{
            name: value
            for name, value in settings.engine_args.items()
            if name not in WorkerSettings.ENGINE_SHORTCUTS
        },
        **shortcut_args(settings),
    }
    return parse_engine_args(fields)


def parse_engine_args(fields: dict[str, Any]) -> AsyncEngineArgs:
    """AsyncEngineArgs from {name: value}, through vLLM's own argument parser: a name it does
    not have, a value of the wrong type or not among its choices, is EngineArgsError naming
    it."""
    known = {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    parser = AsyncEngineArgs.add_cli_args(
        FlexibleArgumentParser(exit_on_error=False)  # type: ignore[no-untyped-call]
    )
    argv: list[str] = []
    for name, value in fields.items():
        if name not in known:
            raise EngineArgsError(name, "vLLM has no such engine argument (`vllm serve --help`)")
        argv += _flag(parser, name, value)
    try:
        namespace, unknown = parser.parse_known_args(argv)  # type: ignore[no-untyped-call]
    except argparse.ArgumentError as exc:
        flag = (exc.argument_name or "").split("/")[0].strip()
        raise EngineArgsError(flag.removeprefix("--").replace("-", "_"), exc.message) from exc
    if unknown:
        raise EngineArgsError(unknown[0], "not an argument vLLM's engine takes")
    made: AsyncEngineArgs = AsyncEngineArgs.from_cli_args(namespace)
    return made


def _flag(parser: argparse.ArgumentParser, name: str, value: Any) -> list[str]:
    """One argument as its command-line flag and value(s)."""
    flag = "--" + name.replace("_", "-")
    action = parser._option_string_actions.get(flag)  # vLLM's parser has no public lookup
    if action is None:
        raise EngineArgsError(name, "not an argument vLLM's engine takes from its command line")
    if value is None:
        raise EngineArgsError(name, "null: leave it out for vLLM's default")
    if isinstance(value, bool):
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + name.replace("_", "-")]
        if action.nargs == 0:  # store_true: false is its default
            return [flag] if value else []
        return [flag, str(value).lower()]
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [flag, *(v if isinstance(v, str) else json.dumps(v) for v in value)]
    if isinstance(value, dict | list):
        return [flag, json.dumps(value)]
    return [flag, str(value)]
