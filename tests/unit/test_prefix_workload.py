"""The shared-prefix workload and the prefix-routing benchmark's arithmetic: reproducible
prompts, prefixes shared exactly, unique suffixes, the skew's share, fresh prefixes per round,
hit ratios and worker shares from two counter snapshots, the pressure workload sized from a KV
cache, every policy against least_request, the generated models' KV cache per token. No timed
assertions."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import shlex
import sys
from collections import Counter
from dataclasses import replace
from itertools import islice
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import cast

import pytest
from tokenizers import Tokenizer

from loadtests.__main__ import add_run_arguments, config_from
from loadtests.prefix_routing import (
    POLICIES,
    PREFIX_WORDS,
    PRESSURE_FACTOR,
    WORKER_DTYPE,
    WORKERS,
    WORKLOADS,
    BestCache,
    check_prefixes_outrun_the_key,
    difference,
    endpoint_requests,
    hit_ratio,
    judged,
    kv_capacity_tokens,
    load_figures,
    markdown,
    max_over_mean,
    pressure_plan,
    rotation,
    selection,
    shares,
    targets,
    worker_counters,
)
from loadtests.runner import RunConfig
from loadtests.workload import Lengths, RequestSpec, Workload
from tests.support import ROOT
from tokenmesh.gateway.core.prefix_key import affinity_key
from tokenmesh.localmesh.mesh import LocalMesh, LocalMeshSettings


def shared(seed: int = 3, text_seed: int = 0, prefixes: int = 8, share: float = 0.0) -> Workload:
    return Workload(
        Lengths.parse("uniform:4:12"),
        Lengths.parse("uniform:8:32"),
        seed,
        prefixes=prefixes,
        prefix_words=PREFIX_WORDS,
        prefix_share=share,
        text_seed=text_seed,
    )


def take(workload: Workload, count: int, shard: int = 0) -> list[RequestSpec]:
    return list(islice(workload.requests(shard), count))


def test_shared_prefix_requests_are_reproducible_from_the_seed() -> None:
    first = take(shared(), 300)
    assert first == take(shared(), 300)
    assert first != take(shared(seed=4), 300)
    assert first != take(shared(), 300, shard=1)
    assert [spec.index for spec in first] == list(range(300))


def test_requests_of_one_prefix_share_exactly_it_and_have_suffixes_of_their_own() -> None:
    workload = shared()
    prefixes = workload.shared_prefixes()
    assert len(set(prefixes)) == len(prefixes) == 8
    assert all(len(prefix.split()) == PREFIX_WORDS for prefix in prefixes)
    specs = take(workload, 500) + take(workload, 500, shard=1)
    suffixes = []
    for spec in specs:
        prefix = prefixes[spec.prefix]
        assert spec.prompt.startswith(prefix + " ")
        suffix = spec.prompt[len(prefix) :]
        # No other prefix starts the prompt: the shared part is exactly this one.
        assert not any(spec.prompt.startswith(other) for other in prefixes if other != prefix)
        suffixes.append(suffix)
    assert len(set(suffixes)) == len(specs)  # unique across both shards


def test_one_prefix_one_affinity_key_and_every_prefix_its_own() -> None:
    """The gateway's key covers only the prefix (which outruns its 1,024 characters)."""
    check_prefixes_outrun_the_key()
    workload = shared()
    keys: dict[int, set[str]] = {}
    for spec in take(workload, 200):
        keys.setdefault(spec.prefix, set()).add(affinity_key(spec.prompt, 1024))
    assert all(len(found) == 1 for found in keys.values())
    assert len({key for found in keys.values() for key in found}) == len(keys)


def test_the_skewed_prefix_gets_the_asked_share_and_the_rest_spread_evenly() -> None:
    specs = take(shared(share=0.5, prefixes=16), 20_000)
    counts = Counter(spec.prefix for spec in specs)
    assert counts[0] / len(specs) == pytest.approx(0.5, abs=0.02)
    others = [counts[index] for index in range(1, 16)]
    mean = sum(others) / len(others)
    assert all(abs(count - mean) / mean < 0.15 for count in others)


def test_without_a_share_every_prefix_is_taken_alike() -> None:
    specs = take(shared(prefixes=8), 16_000)
    counts = Counter(spec.prefix for spec in specs)
    assert sorted(counts) == list(range(8))
    assert all(count / len(specs) == pytest.approx(1 / 8, abs=0.015) for count in counts.values())


def test_per_round_text_seeds_give_disjoint_prefixes_with_the_same_shape() -> None:
    rounds = [shared(text_seed=seed) for seed in range(1, 21)]
    starts = [prefix[:100] for workload in rounds for prefix in workload.shared_prefixes()]
    # Not one prefix, nor even one prefix's first 100 characters (~40 tokens), shared.
    assert len(set(starts)) == len(starts) == 20 * 8
    a, b = take(rounds[0], 200), take(rounds[1], 200)
    assert [(s.prefix, s.max_tokens) for s in a] == [(s.prefix, s.max_tokens) for s in b]
    assert all(x.prompt != y.prompt for x, y in zip(a, b, strict=True))


def test_a_text_seed_alone_changes_the_words_not_the_lengths() -> None:
    """The uniform workload's paired rounds: same lengths, other prompts."""
    base = Workload(Lengths.parse("uniform:4:40"), Lengths.parse("normal:64:16"), 5)
    one, two = (Workload(base.prompt_words, base.output_tokens, 5, text_seed=s) for s in (1, 2))
    a, b = take(one, 100), take(two, 100)
    assert [len(s.prompt.split()) for s in a] == [len(s.prompt.split()) for s in b]
    assert all(x.prompt != y.prompt for x, y in zip(a, b, strict=True))
    assert all(spec.prefix == -1 for spec in a)


def test_workloads_without_prefixes_send_what_they_always_sent() -> None:
    workload = Workload(Lengths.parse("uniform:4:40"), Lengths.parse("normal:64:16"), 7)
    specs = take(workload, 200, shard=1)
    digest = hashlib.sha256(repr([(s.index, s.prompt, s.max_tokens) for s in specs]).encode())
    assert digest.hexdigest() == (
        "3dee93510038da534e0a4c8ab9b85d1873fe51c8f8678cc56dc89b52967c41d7"
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"prefixes": 4},  # no prefix length
        {"prefix_words": 10},  # no prefixes
        {"prefixes": 4, "prefix_words": 10, "prefix_share": 1.0},
        {"prefixes": 1, "prefix_words": 10, "prefix_share": 0.5},
        {"prefixes": -1, "prefix_words": 10},
        {"text_seed": -1},
    ],
)
def test_config_rejects_impossible_prefixes(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RunConfig(target="llm", address="127.0.0.1:1", **fields)  # type: ignore[arg-type]


def test_the_run_command_takes_the_prefix_flags() -> None:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(
        ["--prefixes", "16", "--prefix-words", "360", "--prefix-share", "0.5", "--text-seed", "9"]
    )
    config = config_from(args)
    assert (config.prefixes, config.prefix_words, config.prefix_share, config.text_seed) == (
        16,
        360,
        0.5,
        9,
    )


WORKER_METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="small-llama"} 5000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="small-llama"} 3000.0
# HELP vllm:prompt_tokens_total Prompt tokens.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="small-llama"} 5000.0
# HELP grpc_server_started_total RPCs started on the server.
# TYPE grpc_server_started_total counter
grpc_server_started_total{grpc_method="Generate",grpc_service="tokenmesh.v1.InferenceService",\
grpc_type="SERVER_STREAMING"} 5.0
grpc_server_started_total{grpc_method="Check",grpc_service="grpc.health.v1.Health",\
grpc_type="UNARY"} 90.0
"""

ENVOY_CLUSTERS = """\
worker::default_priority::max_requests::4096
worker::127.0.0.1:20001::cx_active::1
worker::127.0.0.1:20001::rq_total::30
worker::127.0.0.1:20002::rq_total::10
gateway::127.0.0.1:20100::rq_total::40
"""


def test_worker_counters_are_read_from_its_metrics_page() -> None:
    counters = worker_counters(WORKER_METRICS)
    assert counters == {"hits": 3000.0, "queries": 5000.0, "prompt_tokens": 5000.0, "requests": 5.0}


def test_envoy_per_host_requests_of_the_workers_cluster_only() -> None:
    assert endpoint_requests(ENVOY_CLUSTERS) == {"127.0.0.1:20001": 30.0, "127.0.0.1:20002": 10.0}


def test_hit_ratio_and_shares_come_from_the_difference_of_two_snapshots() -> None:
    before = {
        "worker-0": {"hits": 100.0, "queries": 1000.0, "prompt_tokens": 1000.0, "requests": 1.0},
        "worker-1": {"hits": 0.0, "queries": 1000.0, "prompt_tokens": 1000.0, "requests": 1.0},
    }
    after = {
        "worker-0": {"hits": 4100.0, "queries": 7000.0, "prompt_tokens": 7000.0, "requests": 7.0},
        "worker-1": {"hits": 1000.0, "queries": 3000.0, "prompt_tokens": 3000.0, "requests": 3.0},
    }
    grown = difference(before, after)
    assert grown["worker-0"] == {
        "hits": 4000.0,
        "queries": 6000.0,
        "prompt_tokens": 6000.0,
        "requests": 6.0,
    }
    # (4000 + 1000) cached of (6000 + 2000) looked up: what happened between the snapshots.
    assert hit_ratio(grown) == 0.625
    figures = load_figures(grown)
    assert figures["request_shares"] == {"worker-0": 0.75, "worker-1": 0.25}
    assert figures["requests_max_over_mean"] == 1.5
    # Computed (not cached) prompt tokens: 2000 and 1000.
    assert figures["computed_token_shares"] == {"worker-0": 0.6667, "worker-1": 0.3333}
    assert figures["prompt_tokens_per_request"] == 1000.0


def test_no_traffic_gives_no_ratio_rather_than_a_division_by_zero() -> None:
    idle = {"worker-0": dict.fromkeys(("hits", "queries", "prompt_tokens", "requests"), 0.0)}
    assert hit_ratio(idle) is None
    assert max_over_mean({"a": 0.0, "b": 0.0}) is None
    assert shares({"a": 0.0}) == {"a": 0.0}
    assert load_figures(idle)["prompt_tokens_per_request"] is None


def row(workload: str, policy: str, **values: object) -> dict[str, object]:
    base: dict[str, object] = {
        "workload": workload,
        "policy": policy,
        "hit_ratio": 0.5,
        "ttft_ms": {"p50_ms": 100.0, "p99_ms": 400.0},
        "tokens_per_second": 48.0,
        "requests_max_over_mean": 1.0,
        "requests_max_over_mean_per_round": [1.0],
    }
    return {**base, **values}


def judged_rows() -> list[dict[str, object]]:
    return [
        row("shared", "least_request", hit_ratio=0.5),
        row("shared", "prefix", hit_ratio=0.85, ttft_ms={"p50_ms": 60.0, "p99_ms": 300.0}),
        row("shared", "picker", hit_ratio=0.75, ttft_ms={"p50_ms": 75.0, "p99_ms": 200.0}),
        row("uniform", "least_request", hit_ratio=0.0, tokens_per_second=48.0),
        row(
            "uniform",
            "prefix",
            hit_ratio=0.0,
            tokens_per_second=44.0,
            ttft_ms={"p50_ms": 150.0, "p99_ms": 600.0},
        ),
        row("uniform", "picker", hit_ratio=0.0, tokens_per_second=47.0),
        row("skewed", "least_request"),
        row(
            "skewed",
            "prefix",
            requests_max_over_mean=1.2,
            requests_max_over_mean_per_round=[1.1, 1.3],
            computed_tokens_max_over_mean_per_round=[1.1, 1.4],
            ttft_ms={"p50_ms": 90.0, "p99_ms": 390.0},
        ),
        row(
            "skewed",
            "picker",
            requests_max_over_mean_per_round=[1.1, 1.2],
            computed_tokens_max_over_mean_per_round=[1.25, 1.0],
        ),
    ]


def test_every_policy_is_judged_against_least_request() -> None:
    verdicts = targets(judged_rows())
    assert {workload: sorted(v) for workload, v in verdicts.items()} == {
        "shared": ["picker", "prefix"],
        "uniform": ["picker", "prefix"],
        "skewed": ["picker", "prefix"],
    }
    prefix, picker = verdicts["shared"]["prefix"], verdicts["shared"]["picker"]
    assert (prefix["hit_ratio_gain"], prefix["ttft_p50_drop"]) == (1.7, 0.4)
    assert prefix["hit_ratio_met"] and prefix["ttft_p50_met"]
    # 1.5x the hits is short of 1.6x; 25 % lower TTFT p50 short of 30 %.
    assert (picker["hit_ratio_gain"], picker["ttft_p50_drop"]) == (1.5, 0.25)
    assert not picker["hit_ratio_met"] and not picker["ttft_p50_met"]
    assert picker["ttft_p99_ratio"] == 0.5
    uniform = verdicts["uniform"]
    assert uniform["prefix"]["tokens_per_second_ratio"] == pytest.approx(0.917, abs=0.001)
    assert uniform["prefix"]["ttft_p50_drop"] == -0.5  # reported, not judged there
    assert not uniform["prefix"]["tokens_per_second_met"]
    assert uniform["picker"]["tokens_per_second_met"]
    assert "hit_ratio_met" not in uniform["picker"]
    faster = {"hit_ratio_gain": None, "ttft_p50_drop": 0.1, "tokens_per_second_ratio": 1.2}
    assert judged("uniform", faster)["tokens_per_second_met"]  # faster is no failure
    # Balanced over all rounds, but one round's busiest worker was over 1.25x the mean.
    assert verdicts["skewed"]["prefix"]["requests_max_over_mean_worst_round"] == 1.3
    assert not verdicts["skewed"]["prefix"]["balance_met"]
    # And its busiest worker computed 1.4x the mean's prompt tokens in one round.
    assert verdicts["skewed"]["prefix"]["computed_max_over_mean_worst_round"] == 1.4
    assert not verdicts["skewed"]["prefix"]["work_balance_met"]
    assert verdicts["skewed"]["picker"]["work_balance_met"]
    assert verdicts["skewed"]["prefix"]["ttft_p99_met"]
    assert (
        verdicts["skewed"]["picker"]["balance_met"] and verdicts["skewed"]["picker"]["ttft_p99_met"]
    )


def test_without_least_requests_rows_a_workload_is_not_judged() -> None:
    verdicts = targets([row("pressure", "prefix"), row("few", "least_request")])
    assert verdicts == {}


def test_the_summary_sets_each_policy_against_least_request() -> None:
    rows = [
        {
            **r,
            "rate": 2.5,
            "requests": 100,
            "errors": 0,
            "request_shares": {"worker-0": 0.5, "worker-1": 0.5},
            "computed_token_shares": {"worker-0": 0.5, "worker-1": 0.5},
            "envoy_endpoint_shares": {},
            "cpu": {"envoy": {"ms_per_request": 5.0}},
            "hit_ratio_per_round": [r["hit_ratio"]],
        }
        for r in judged_rows()
    ]
    notes = {
        "policies": list(POLICIES),
        "model": "models/pressure-llama",
        "worker_dtype": WORKER_DTYPE,
        "kv_capacity_tokens": 16384,
        "rounds": 3,
        "round_seconds": 30.0,
        "prefix_tokens": 1030.4,
        "prefill": {"worker-0": {"uncached_ms": 700.0, "cached_ms": 40.0}},
        "plans": [{"name": "shared", "what": "16 prefixes", "rate": 2.5}],
    }
    text = markdown(rows, targets(rows), notes)  # type: ignore[arg-type]
    assert (
        "| shared | prefix | 1.70 | 40% | 0.75 | 1.00 | 1 | n/a | hit ratio >= 1.6x: yes; " in text
    )
    assert (
        "| shared | picker | 1.50 | 25% | 0.50 | 1.00 | 1 | n/a | hit ratio >= 1.6x: NO; " in text
    )
    assert (
        "| uniform | prefix | n/a | -50% | 1.50 | 0.92 | 1 | n/a | tokens/s at most 5% lower: NO |"
        in text
    )
    assert "| skewed | prefix |" in text and "max/mean <= 1.25 every round: NO" in text
    assert "| skewed | picker | 1.00 | 0% | 1.00 | 1.00 | 1.2 | 1.25 | max/mean <= 1.25" in text
    assert "KV cache of 16,384 tokens a worker" in text
    assert "Picker settings: the gateway's defaults." in text
    given = {**notes, "picker_environment": {"TOKENMESH_GATEWAY_PICKER__SLACK_STREAMS": "0"}}
    text = markdown(rows, targets(rows), given)  # type: ignore[arg-type]
    assert "Picker settings: TOKENMESH_GATEWAY_PICKER__SLACK_STREAMS=0." in text


CACHE_CONFIG_INFO = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",\
engine="0",kv_cache_size_tokens="16384",num_cpu_blocks="None",num_gpu_blocks="128"} 1.0
"""


def test_a_workers_kv_capacity_is_what_its_engine_reports() -> None:
    assert kv_capacity_tokens(WORKER_METRICS + CACHE_CONFIG_INFO) == 128 * 128
    assert kv_capacity_tokens(WORKER_METRICS) is None
    assert kv_capacity_tokens(CACHE_CONFIG_INFO.replace('"128"}', '"None"}')) is None


def test_the_pressure_workload_outgrows_one_cache_and_fits_in_both() -> None:
    assert 1 < PRESSURE_FACTOR < WORKERS
    plan = pressure_plan(capacity_tokens=16384, prefix_tokens=1030.0, uncached_ms=600.0, uses=6)
    # 1.5 x 16,384 tokens in prefixes of 1,030: 24 of them (24,720 tokens).
    assert plan.prefixes == 24
    assert plan.prefixes * 1030 > 16384 and plan.prefixes * 1030 / WORKERS < 16384
    # 60 % of the two workers' uncached rate (2 / 0.6 s), each prefix ~6 times a round.
    assert plan.rate == 2.0
    assert plan.seconds == 72.0
    assert plan.prefix_share == 0.0 and plan.name == "pressure"
    assert "24 prefixes of ~1,030 tokens" in plan.what
    # A bigger cache, more prefixes; never fewer than two.
    assert pressure_plan(65536, 1030.0, 600.0, 6).prefixes == 95
    assert pressure_plan(1000, 1030.0, 600.0, 6).prefixes == 2


def test_options_choose_among_the_known_names_in_their_own_order() -> None:
    assert selection("pressure, uniform,skewed", WORKLOADS) == ("uniform", "skewed", "pressure")
    assert selection("prefix,least_request", POLICIES) == ("least_request", "prefix")
    for wrong in ("", ",", "prefix,hash"):
        with pytest.raises(ValueError):
            selection(wrong, POLICIES)


def test_rounds_rotate_which_policy_goes_first() -> None:
    orders = [rotation(["a", "b", "c"], number) for number in range(4)]  # type: ignore[arg-type]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert [rotation(["a", "b"], n) for n in range(2)] == [["a", "b"], ["b", "a"]]  # type: ignore[arg-type]


def test_the_workers_get_the_meshs_dtype(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    for dtype in ("auto", "float32"):
        settings = LocalMeshSettings.on_free_ports(tmp_path, workers=2, worker_dtype=dtype)
        workers = [p for p in LocalMesh(settings, root).programs if p.service == "worker"]
        assert [p.env["TOKENMESH_WORKER_DTYPE"] for p in workers] == [dtype, dtype]
    assert LocalMeshSettings().worker_dtype == "auto"


def tiny_model_script() -> ModuleType:
    """scripts/make_tiny_model.py, imported from its file (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "make_tiny_model", ROOT / "scripts" / "make_tiny_model.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Its dataclass looks its module up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_tiny_models_marker_is_unchanged_and_a_larger_one_says_its_sizes() -> None:
    script = tiny_model_script()
    assert script.Shape().marker() == {"vocab_size": 2048, "hidden_size": 128, "layers": 2}
    larger = script.Shape(hidden_size=768, heads=12, layers=8, intermediate_size=2048)
    assert larger.marker() == {
        "vocab_size": 2048,
        "hidden_size": 768,
        "layers": 8,
        "heads": 12,
        "intermediate_size": 2048,
    }


def makefile_shape(script: ModuleType, variable: str) -> object:
    """The Shape a Makefile variable's flags (--hidden-size 512 ...) make."""
    line = next(
        line
        for line in (ROOT / "Makefile").read_text().splitlines()
        if line.startswith(f"{variable} :=")
    )
    flags = shlex.split(line.split(":=", 1)[1])
    values = {
        flag.removeprefix("--").replace("-", "_"): value if flag == "--dtype" else int(value)
        for flag, value in zip(flags[::2], flags[1::2], strict=True)
    }
    return script.Shape(**values)


def test_the_pressure_models_cache_holds_a_few_prefixes_and_the_small_ones_many() -> None:
    script = tiny_model_script()
    small = makefile_shape(script, "SMALL_MODEL_SHAPE")
    pressure = makefile_shape(script, "PRESSURE_MODEL_SHAPE")
    # 2 (key, value) x 4 layers x 512 wide x 4 bytes: 16 KiB a token, 65,536 tokens a GiB.
    assert small.kv_bytes_per_token() == 16_384  # type: ignore[attr-defined]
    assert small.kv_tokens_per_gib() == 65_536  # type: ignore[attr-defined]
    assert 8_192 <= pressure.kv_tokens_per_gib() <= 16_384  # type: ignore[attr-defined]
    assert script.Shape().kv_bytes_per_token() == 2 * 2 * 128 * 2


class CharTokens:
    """A tokenizer whose tokens are the prompt's characters (for BestCache's arithmetic)."""

    def encode(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(ids=[ord(c) for c in text])


def common_start(one: str, other: str) -> int:
    """How many characters the two start with alike."""
    return next(
        (i for i, (a, b) in enumerate(zip(one, other, strict=False)) if a != b),
        min(len(one), len(other)),
    )


def test_the_best_cache_hits_whole_blocks_of_a_prefix_seen_before() -> None:
    config = RunConfig(
        target="llm",
        address="127.0.0.1:1",
        rate=1.0,
        mode="open",
        prompt_words="3",
        output_tokens="1",
        seed=7,
        prefixes=2,
        prefix_words=40,
        text_seed=70,
    )
    specs = list(islice(config.workload().requests(), 12))
    best = BestCache(cast(Tokenizer, CharTokens()), block_size=16)
    counts = best.counts(config, 12)
    assert counts["queries"] == sum(len(spec.prompt) for spec in specs)
    # Each prompt finds its longest common start with any earlier one, in whole blocks, short
    # of its last token.
    expected = 0
    for number, spec in enumerate(specs):
        common = max(
            (common_start(spec.prompt, earlier.prompt) for earlier in specs[:number]),
            default=0,
        )
        expected += min(common, len(spec.prompt) - 1) // 16 * 16
    assert counts["hits"] == expected > 0
    # No prefixes, no hits; and a prompt seen whole still computes its last token.
    alone = replace(config, prefixes=0, prefix_words=0, prompt_words="30", text_seed=0)
    assert best.counts(alone, 5)["hits"] == 0
    cache = BestCache(cast(Tokenizer, CharTokens()), block_size=4)
    assert cache.look_up(list(range(10))) == 0
    assert cache.look_up(list(range(10))) == 8  # 2 whole blocks; the last 2 tokens computed
    assert cache.look_up(list(range(8))) == 4  # seen whole: its last block is computed
    assert cache.look_up([0, 1, 2, 9, 4, 5, 6, 7]) == 0  # the first block differs
