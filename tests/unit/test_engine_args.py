"""The worker's engine arguments, made by vLLM's own parser and configuration code from the tiny
model: vLLM's defaults where nothing is set, every engine argument reachable, and a wrong one
named before anything starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser

from tests.support import TINY_MODEL
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine_args import EngineArgsError, engine_args, parse_engine_args


def config(arguments: AsyncEngineArgs) -> Any:
    """The engine's configuration, as the worker builds it (the usage context `vllm serve`
    has)."""
    return arguments.create_engine_config(UsageContext.OPENAI_API_SERVER)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's files with a context of 4096 positions (the worker's old default cap
    was 2048)."""
    made = tmp_path_factory.mktemp("long") / "tiny-long"
    shutil.copytree(TINY_MODEL, made)
    settings = json.loads((made / "config.json").read_text())
    settings["max_position_embeddings"] = 4096
    (made / "config.json").write_text(json.dumps(settings))
    return made


def test_unset_context_and_batch_are_what_vllm_serve_chooses(long_model: Path) -> None:
    ours = config(engine_args(WorkerSettings(model=str(long_model))))
    # `vllm serve --model ...`: its own parser, arguments and usage context.
    parser = make_arg_parser(FlexibleArgumentParser())  # type: ignore[no-untyped-call]
    served = config(AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", str(long_model)])))
    assert ours.model_config.max_model_len == 4096 == served.model_config.max_model_len
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        assert getattr(ours.scheduler_config, name) == getattr(served.scheduler_config, name), name


def test_engine_args_reach_vllm_and_shortcuts_still_set_theirs() -> None:
    settings = WorkerSettings(
        model=str(TINY_MODEL),
        max_model_len=1024,
        engine_args={"max-num-batched-tokens": 1536, "enable_prefix_caching": False, "seed": 7},
    )
    made = config(engine_args(settings))
    assert made.scheduler_config.max_num_batched_tokens == 1536
    assert made.cache_config.enable_prefix_caching is False
    assert made.model_config.seed == 7
    assert made.model_config.max_model_len == 1024


def test_an_engine_arg_fills_a_shortcut_left_unset_and_one_that_disagrees_is_an_error() -> None:
    settings = WorkerSettings(engine_args={"max_model_len": 1024, "served_model_name": ["tiny"]})
    assert settings.max_model_len == 1024 and settings.model_name == "tiny"
    agreed = WorkerSettings(max_model_len=1024, engine_args={"max_model_len": "1024"})
    assert agreed.max_model_len == 1024
    with pytest.raises(
        ValidationError, match=r"engine_args\.max_model_len is 2048 but the setting"
    ):
        WorkerSettings(max_model_len=1024, engine_args={"max_model_len": 2048})
    # An engine argument named as vLLM names it; the setting's own name differs.
    assert WorkerSettings(engine_args={"max_logprobs": 5}).max_top_logprobs == 5
    with pytest.raises(ValidationError, match=r"max_logprobs is 5 but the setting max_top_"):
        WorkerSettings(max_top_logprobs=20, engine_args={"max_logprobs": 5})
    with pytest.raises(ValidationError, match=r"enable_log_requests: set by the worker"):
        WorkerSettings(engine_args={"enable_log_requests": True})


@pytest.mark.parametrize(
    ("fields", "named", "says"),
    [
        ({"no_such_argument": 1}, "no_such_argument", "no such engine argument"),
        ({"max_num_batched_tokens": "many"}, "max_num_batched_tokens", "invalid"),
        ({"kv_cache_dtype": "fp9"}, "kv_cache_dtype", "invalid choice"),
        ({"enforce_eager": None}, "enforce_eager", "null"),
    ],
)
def test_a_wrong_engine_arg_is_named_with_vllms_reason(
    fields: dict[str, Any], named: str, says: str
) -> None:
    with pytest.raises(EngineArgsError) as error:
        parse_engine_args({"model": str(TINY_MODEL), **fields})
    assert error.value.name == named and says in str(error.value)


def test_booleans_lists_and_objects_become_vllms_flags() -> None:
    made = parse_engine_args(
        {
            "model": str(TINY_MODEL),
            "enforce_eager": True,
            "trust_remote_code": False,
            "served_model_name": ["a", "b"],
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
        }
    )
    assert made.enforce_eager is True and made.trust_remote_code is False
    assert made.served_model_name == ["a", "b"]
    assert made.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
