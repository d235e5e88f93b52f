"""Prefix-cache-aware routing (issue #19) measured: least_request, prefix and picker on one mesh.

A private mesh of 1 gateway and 2 workers on a generated model (by default models/small-llama,
whose prefill is slow enough for a prefix-cache hit to show in TTFT; models/pressure-llama's
KV cache holds only a few thousand tokens a GiB, for the pressure workload) and an Envoy for
each worker_routing policy in front of the same gateway and workers, all on the direct token
path (the edge routes each stream straight to a worker), each started and placed alike in a
session of its own: least_request, prefix (Maglev hashing of the gateway's affinity key) and
picker (the workers the gateway's endpoint picker names, whose feed of the workers' load is on
when picker is measured). Open-loop (Poisson) load, one edge at a time, in interleaved rounds whose
order rotates (A B C, B C A, ...); in each round every edge gets the same arrivals, lengths and
prefix choices with text of its own, so none profits from a prefix another put in a cache.
Workloads:

shared    P prefixes of ~1,000 tokens, each request a prefix and a unique suffix
few       the same with many more prefixes, each used only a few times per round
uniform   no shared prefixes (prompts as long, every one its own)
skewed    as shared, one prefix taking half the requests
pressure  prefixes of ~1,000 tokens totalling 1.5x one worker's KV cache (as its engine reports
          it), each used several times a round in a random order: least_request makes both
          workers cache them all and evict, split over two workers they fit; its rate is a
          share of what the workers serve uncached (the prefill measured before the rounds)

Per policy and workload: the prefix-cache hit ratio from vLLM's own counters on each worker
(vllm:prefix_cache_hits/queries, read before and after each round), TTFT p50/p99, tokens/s,
each worker's share of the requests (its own gRPC counter, and the loaded Envoy's per-host
rq_total), CPU per request and per token of each process from /proc; before the rounds, the
prefill time of a ~1,000-token prompt on each worker, uncached and cached. The summary sets
each policy against least_request, with the issue's targets.

    python -m loadtests.prefix_routing [--quick] [--rounds N] [--out DIR] [--model DIR]
        [--workloads shared,few,uniform,skewed]
        [--policies least_request,prefix,picker,prefix+relay,picker+relay,least_request+relay]
    python -m loadtests.prefix_routing --model models/pressure-llama \
        --workloads pressure,uniform,skewed
    python -m loadtests bench --scenarios prefix

Results: loadtests/results/<date>/prefix-routing/ (a JSON per workload and policy,
summary.json, summary.md, TTFT CDFs). All traffic goes to 127.0.0.1; every run is bounded in
duration and request count.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from loadtests import report
from loadtests.runner import RunConfig, combine, one_request, run
from loadtests.scenarios import RESULTS, ROOT, Bench, private_mesh
from loadtests.targets import WorkerTarget
from loadtests.token_cost import cpu_seconds
from loadtests.workload import Lengths, RequestSpec, Workload
from tests.harness.meshes import second_envoy
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.localmesh.mesh import LocalMesh, envoy_hosts
from tokenmesh.worker.placement import descendants

SCENARIO = "prefix-routing"
SMALL_MODEL = "models/small-llama"
# The workers compute in float32: vLLM's "auto" dtype turns a float32 model into bfloat16,
# which vLLM's CPU backend computes natively only with AVX-512's bf16 instructions (on AVX2
# it prefilled 6x slower).
WORKER_DTYPE = "float32"
WORKERS = 2
# Every other policy is set against this one.
BASELINE = "least_request"
POLICIES = (BASELINE, "prefix", "picker")
# A policy with this suffix: its edge sends the workers' streams through the edge's stream
# relay (stream_relay) instead of Envoy's router.
RELAYED = "+relay"
CHOICES = POLICIES + tuple(policy + RELAYED for policy in POLICIES)


def routing_of(policy: str) -> str:
    """The worker_routing of a policy, relayed or not."""
    return policy.removesuffix(RELAYED)


WORKLOADS = ("shared", "few", "uniform", "skewed", "pressure")
DEFAULT_WORKLOADS = ("shared", "few", "uniform", "skewed")
# The pressure workload: prefixes whose tokens total this many times one worker's KV cache
# (more than one worker holds, less than the workers together), each taken by about this many
# requests a round (fewer in a quick run), at this share of the requests/s the workers serve
# when every prompt is computed.
PRESSURE_FACTOR = 1.5
PRESSURE_USES = 6
PRESSURE_USES_QUICK = 4
PRESSURE_LOAD = 0.6
# A prefix of this many words is ~1,000 tokens of the models' tokenizer (2.75 tokens and 6.4
# characters a word), well past the gateway's affinity key (its first 1,024 characters).
PREFIX_WORDS = 360
SUFFIX_WORDS = "uniform:8:24"
OUTPUT_TOKENS = "16"
# vLLM's counters each worker's metrics port has (sample names as Prometheus reads them).
VLLM_COUNTERS = {
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prompt_tokens_total": "prompt_tokens",
}
WORKER_METHODS = ("Generate", "GenerateOpenAI")
# The targets, against least_request: on the workloads that share prefixes a hit ratio
# this many times as high and a TTFT p50 this much lower; on uniform, tokens/s at most this
# much lower; on skewed, no worker above this many times the mean requests, and no worse TTFT p99.
HIT_WORKLOADS = ("shared", "few", "pressure")
HIT_RATIO_GAIN = 1.6
TTFT_P50_DROP = 0.30
TOKENS_PER_SECOND_BAND = 0.05
MAX_OVER_MEAN = 1.25
TARGETS = {
    "hit_ratio_met": f"hit ratio >= {HIT_RATIO_GAIN:g}x",
    "ttft_p50_met": f"TTFT p50 >= {TTFT_P50_DROP:.0%} lower",
    "tokens_per_second_met": f"tokens/s at most {TOKENS_PER_SECOND_BAND:.0%} lower",
    "balance_met": f"max/mean <= {MAX_OVER_MEAN:g} every round",
    "work_balance_met": f"computed tokens max/mean <= {MAX_OVER_MEAN:g} every round",
    "ttft_p99_met": "TTFT p99 no worse",
}


@dataclass(frozen=True)
class Plan:
    """One workload: its name, what it is, its load and its prompts."""

    name: str
    what: str
    rate: float  # requests/s
    prefixes: int = 0
    prefix_share: float = 0.0
    prompt_words: str = SUFFIX_WORDS
    # Each round's length, s (None: the run's).
    seconds: float | None = None

    def config(self, edge: Edge, seconds: float, seed: int, text_seed: int) -> RunConfig:
        return RunConfig(
            target="llm",
            address=edge.address,
            mode="open",
            rate=self.rate,
            duration=seconds,
            # Bounded by time; the request budget only caps a runaway schedule.
            requests=int(self.rate * seconds * 2) + 10,
            warmup=0.0,
            prompt_words=self.prompt_words,
            output_tokens=OUTPUT_TOKENS,
            seed=seed,
            text_seed=text_seed,
            prefixes=self.prefixes,
            prefix_words=PREFIX_WORDS if self.prefixes else 0,
            prefix_share=self.prefix_share,
            timeout=60.0,
            label=f"{self.name} {edge.policy}",
        )


def plans() -> list[Plan]:
    """The workloads, each at a rate the two workers serve without a growing queue."""
    whole = f"uniform:{PREFIX_WORDS + 8}:{PREFIX_WORDS + 24}"
    return [
        Plan("shared", "16 prefixes of ~1,000 tokens, many requests each", 2.5, prefixes=16),
        Plan("few", "32 prefixes of ~1,000 tokens, ~2 requests each", 2.5, prefixes=32),
        Plan("uniform", "no shared prefix, prompts as long", 1.5, prompt_words=whole),
        Plan("skewed", "16 prefixes, one of them half the requests", 2.5, 16, 0.5),
    ]


def pressure_plan(
    capacity_tokens: int, prefix_tokens: float, uncached_ms: float, uses: int
) -> Plan:
    """The pressure workload for workers whose KV caches hold capacity_tokens each, prefixes of
    prefix_tokens and a prefill of uncached_ms: prefixes totalling PRESSURE_FACTOR caches, at
    PRESSURE_LOAD of the requests/s the workers serve uncached, rounds long enough for `uses`
    requests of each prefix."""
    if not 1 < PRESSURE_FACTOR < WORKERS:
        raise ValueError("the prefixes must outgrow one worker's cache and fit in all of them")
    prefixes = max(2, round(PRESSURE_FACTOR * capacity_tokens / prefix_tokens))
    rate = round(PRESSURE_LOAD * WORKERS * 1e3 / uncached_ms, 2)
    return Plan(
        "pressure",
        f"{prefixes} prefixes of ~{prefix_tokens:,.0f} tokens ({PRESSURE_FACTOR:g}x a worker's "
        f"KV cache of {capacity_tokens:,} tokens), ~{uses} requests each a round",
        rate,
        prefixes=prefixes,
        seconds=round(prefixes * uses / rate, 1),
    )


def selection(text: str, names: Sequence[str]) -> tuple[str, ...]:
    """The names a comma-separated option chose, in the order of `names`."""
    chosen = {name.strip() for name in text.split(",") if name.strip()}
    unknown = chosen - set(names)
    if unknown or not chosen:
        raise ValueError(f"choose among {', '.join(names)}, not {text!r}")
    return tuple(name for name in names if name in chosen)


def rotation(items: Sequence[Edge], number: int) -> list[Edge]:
    """Round `number`'s order: each round starts one further along (A B C, B C A, C A B)."""
    start = number % len(items)
    return [*items[start:], *items[:start]]


@dataclass(frozen=True)
class Edge:
    """An Envoy edge under test: its worker_routing, address, admin port and process."""

    policy: str
    address: str
    admin_port: int
    pid: int


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return str(reply.read().decode())


def worker_counters(text: str) -> dict[str, float]:
    """A worker's prefix-cache hits and queries (tokens), prompt tokens and streams started,
    from its metrics page (each summed over its labels)."""
    totals = dict.fromkeys(("hits", "queries", "prompt_tokens", "requests"), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in VLLM_COUNTERS:
                totals[VLLM_COUNTERS[sample.name]] += sample.value
            elif (
                sample.name == "grpc_server_started_total"
                and sample.labels.get("grpc_service", "").endswith("InferenceService")
                and sample.labels.get("grpc_method") in WORKER_METHODS
            ):
                totals["requests"] += sample.value
    return totals


def cache_config(text: str) -> tuple[int, int] | None:
    """A worker's KV cache as its engine reports it on its metrics page
    (vllm:cache_config_info): (blocks, tokens a block); None: not there."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                blocks = sample.labels.get("num_gpu_blocks", "")
                size = sample.labels.get("block_size", "")
                if blocks.isdigit() and size.isdigit():
                    return int(blocks), int(size)
    return None


def kv_capacity_tokens(text: str) -> int | None:
    """The tokens a worker's KV cache holds (None: its engine does not say)."""
    found = cache_config(text)
    return None if found is None else found[0] * found[1]


class BestCache:
    """The hit ratio of one prefix cache of unbounded size that saw a round's requests in the
    order they were sent: the most any routing over the workers' caches could hit (each of
    them holds less, and a prompt's blocks are found only where that prompt's prefix went).
    vLLM's rule: a hit is a whole block of the prompt whose every earlier block hit too, and
    the prompt's last token is always computed."""

    def __init__(self, tokenizer: Tokenizer, block_size: int) -> None:
        self._tokenizer = tokenizer
        self._block = block_size
        # Each cached block's key: a hash of the blocks before it and its own tokens.
        self._seen: set[int] = set()

    def counts(self, config: RunConfig, requests: int) -> dict[str, int]:
        """Prompt tokens looked up and found, over the round's first `requests` requests
        (the generator sends them in order, from one process: shard 0), from an empty cache."""
        self._seen.clear()
        hits = queries = 0
        for spec in islice(config.workload().requests(), requests):
            ids = self._tokenizer.encode(spec.prompt).ids
            queries += len(ids)
            hits += self.look_up(ids)
        return {"hits": hits, "queries": queries}

    def look_up(self, ids: Sequence[int]) -> int:
        """The prompt's tokens found cached; then all its whole blocks are."""
        chain, found, hits = 0, True, 0
        for end in range(self._block, len(ids) + 1, self._block):
            chain = hash((chain, tuple(ids[end - self._block : end])))
            found = found and chain in self._seen and end < len(ids)
            hits += self._block if found else 0
            self._seen.add(chain)
        return hits


def prefix_tokens(tokenizer: Tokenizer) -> float:
    """The mean length in the model's tokens of the benchmark's prefixes."""
    sample = Workload(
        Lengths.parse("1"), Lengths.parse("1"), 1, prefixes=16, prefix_words=PREFIX_WORDS
    )
    prefixes = sample.shared_prefixes()
    return sum(len(tokenizer.encode(prefix).ids) for prefix in prefixes) / len(prefixes)


def endpoint_requests(text: str, cluster: str = "worker") -> dict[str, float]:
    """Requests Envoy sent to each host of `cluster`, by address, from its admin /clusters
    (lines CLUSTER::HOST::rq_total::N; the cluster's own lines have no address for HOST)."""
    counts: dict[str, float] = {}
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and ":" in parts[1] and parts[2] == "rq_total":
            counts[parts[1]] = float(parts[3])
    return counts


def difference(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Each worker's counters' growth between two snapshots."""
    return {
        name: {key: after[name][key] - value for key, value in counters.items()}
        for name, counters in before.items()
    }


def hit_ratio(workers: dict[str, dict[str, float]]) -> float | None:
    """Cached prompt tokens over prompt tokens looked up, over every worker."""
    queries = sum(counters["queries"] for counters in workers.values())
    hits = sum(counters["hits"] for counters in workers.values())
    return round(hits / queries, 4) if queries else None


def shares(counts: dict[str, float]) -> dict[str, float]:
    """Each one's share of the total."""
    total = sum(counts.values())
    return {name: round(value / total, 4) if total else 0.0 for name, value in counts.items()}


def max_over_mean(counts: dict[str, float]) -> float | None:
    """The busiest one's count over the mean count (1.0: perfectly even)."""
    total = sum(counts.values())
    return round(max(counts.values()) * len(counts) / total, 3) if total else None


def load_figures(
    workers: dict[str, dict[str, float]], best: dict[str, float] | None = None
) -> dict[str, Any]:
    """From the workers' counter growth: the hit ratio (and the best any routing could have,
    from BestCache's counts), each worker's share of the requests and of the prompt tokens it
    computed (not from its cache), and the busiest over the mean."""
    requests = {name: counters["requests"] for name, counters in workers.items()}
    computed = {name: counters["queries"] - counters["hits"] for name, counters in workers.items()}
    ratio_now = hit_ratio(workers)
    best_ratio = hit_ratio({"best": best}) if best else None
    return {
        "hit_ratio": ratio_now,
        "best_hit_ratio": best_ratio,
        "of_best": round(ratio_now / best_ratio, 3) if ratio_now and best_ratio else None,
        "request_shares": shares(requests),
        "requests_max_over_mean": max_over_mean(requests),
        "computed_token_shares": shares(computed),
        "computed_tokens_max_over_mean": max_over_mean(computed),
        "prompt_tokens_per_request": (
            round(sum(c["prompt_tokens"] for c in workers.values()) / sum(requests.values()), 1)
            if sum(requests.values())
            else None
        ),
    }


class Mesh:
    """What the benchmark reads from the mesh: workers' counters, processes' CPU."""

    def __init__(self, local_mesh: LocalMesh) -> None:
        self.workers = local_mesh.replicas("worker")
        pids = {program.name: local_mesh.pid(program.name) for program in self.workers}
        self.processes = {
            **{name: [pid] for name, pid in pids.items()},
            **{name.replace("worker", "engine"): descendants(pid) for name, pid in pids.items()},
            "gateway": [local_mesh.pid("gateway-0")],
        }

    def pages(self) -> dict[str, str]:
        return {
            program.name: scrape(f"http://127.0.0.1:{program.metrics_port}/metrics")
            for program in self.workers
        }

    def counters(self) -> dict[str, dict[str, float]]:
        return {name: worker_counters(text) for name, text in self.pages().items()}

    def block_size(self) -> int:
        """The tokens in a KV-cache block (every worker's engine alike)."""
        sizes = {found[1] for found in map(cache_config, self.pages().values()) if found}
        if len(sizes) != 1:
            raise SystemExit(f"the workers' engines report block sizes {sizes or 'none'}")
        return sizes.pop()

    def kv_capacity(self) -> int:
        """The smallest of the workers' KV caches, in tokens."""
        found = {name: kv_capacity_tokens(text) for name, text in self.pages().items()}
        if any(tokens is None for tokens in found.values()):
            raise SystemExit(f"a worker reports no KV cache size (vllm:cache_config_info): {found}")
        return min(tokens for tokens in found.values() if tokens is not None)

    def cpu(self, edge: Edge) -> dict[str, float]:
        processes = {**self.processes, "envoy": [edge.pid]}
        return {name: cpu_seconds(pids) for name, pids in processes.items()}


def measured_round(config: RunConfig, edge: Edge, mesh: Mesh, best: BestCache) -> dict[str, Any]:
    """One run through one edge, with the growth of the workers' counters, the edge's
    per-host requests and each process's CPU seconds over it, and the best cache's counts."""
    stats = f"http://127.0.0.1:{edge.admin_port}/clusters"
    counters, endpoints, cpu = mesh.counters(), endpoint_requests(scrape(stats)), mesh.cpu(edge)
    result = run(config, show_progress=False)
    # The runner returns once every stream has ended: the counters hold the whole round.
    workers = difference(counters, mesh.counters())
    after = endpoint_requests(scrape(stats))
    result["workers"] = workers
    result["envoy_endpoint_requests"] = {
        address: value - endpoints.get(address, 0.0) for address, value in after.items()
    }
    result["cpu_seconds"] = {name: value - cpu[name] for name, value in mesh.cpu(edge).items()}
    result["best_cache"] = best.counts(config, result["requests"])
    result["prefix"] = load_figures(workers, result["best_cache"])
    return result


def combined(results: list[dict[str, Any]]) -> dict[str, Any]:
    """A policy's rounds of one workload as one result: histograms merged, counters summed."""
    total = combine(results)
    workers: dict[str, Counter[str]] = {}
    endpoints: Counter[str] = Counter()
    cpu: Counter[str] = Counter()
    best: Counter[str] = Counter()
    for result in results:
        best.update(result["best_cache"])
        for name, counters in result["workers"].items():
            workers.setdefault(name, Counter()).update(counters)
        endpoints.update(result["envoy_endpoint_requests"])
        cpu.update(result["cpu_seconds"])
    total["workers"] = {name: dict(counters) for name, counters in workers.items()}
    total["envoy_endpoint_requests"] = dict(endpoints)
    total["cpu_seconds"] = dict(cpu)
    total["best_cache"] = dict(best)
    total["prefix"] = {
        **load_figures(total["workers"], total["best_cache"]),
        "envoy_endpoint_shares": shares(dict(endpoints)),
        "per_round": [result["prefix"] for result in results],
    }
    return total


def cpu_costs(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """CPU ms per request and µs per generated token of each process."""
    requests, tokens = result["requests"], result["tokens_received"]
    return {
        name: {
            "ms_per_request": round(seconds * 1e3 / requests, 1) if requests else 0.0,
            "us_per_token": round(seconds * 1e6 / tokens, 1) if tokens else 0.0,
        }
        for name, seconds in result["cpu_seconds"].items()
    }


def row(plan: Plan, policy: str, result: dict[str, Any]) -> dict[str, Any]:
    figures = result["prefix"]
    return {
        "workload": plan.name,
        "policy": policy,
        "rate": plan.rate,
        "requests": result["requests"],
        "errors": result["errors"],
        "hit_ratio": figures["hit_ratio"],
        "hit_ratio_per_round": [r["hit_ratio"] for r in figures["per_round"]],
        "best_hit_ratio": figures["best_hit_ratio"],
        "of_best": figures["of_best"],
        "ttft_ms": {k: result["ttft_ms"][k] for k in ("p50_ms", "p99_ms")},
        "tokens_per_second": result["tokens_per_second"],
        "request_shares": figures["request_shares"],
        "requests_max_over_mean": figures["requests_max_over_mean"],
        "requests_max_over_mean_per_round": [
            r["requests_max_over_mean"] for r in figures["per_round"]
        ],
        "computed_token_shares": figures["computed_token_shares"],
        "computed_tokens_max_over_mean_per_round": [
            r["computed_tokens_max_over_mean"] for r in figures["per_round"]
        ],
        "envoy_endpoint_shares": figures["envoy_endpoint_shares"],
        "prompt_tokens_per_request": figures["prompt_tokens_per_request"],
        "cpu": cpu_costs(result),
        "send_lag_p99_ms": result["generator"]["send_lag_ms"].get("p99_ms"),
    }


def ratio(value: float | None, base: float | None, digits: int = 3) -> float | None:
    """value over base (None when either is missing, or base is zero)."""
    return round(value / base, digits) if value is not None and base else None


def versus(baseline: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """A policy's row against least_request's: hit ratio, TTFT p99 and tokens/s as ratios, the
    TTFT p50 as the share it is lower by."""
    p50 = ratio(other["ttft_ms"]["p50_ms"], baseline["ttft_ms"]["p50_ms"], 6)
    return {
        "hit_ratio_gain": ratio(other["hit_ratio"], baseline["hit_ratio"], 2),
        "ttft_p50_drop": round(1 - p50, 3) if p50 is not None else None,
        "ttft_p99_ratio": ratio(other["ttft_ms"]["p99_ms"], baseline["ttft_ms"]["p99_ms"]),
        "tokens_per_second_ratio": ratio(other["tokens_per_second"], baseline["tokens_per_second"]),
        "requests_max_over_mean_worst_round": max(
            [other["requests_max_over_mean"] or 0.0, *other["requests_max_over_mean_per_round"]]
        ),
        # The prompt tokens the engines computed (a cached request costs a fraction of one
        # that is not): the busiest worker's over the mean, in the worst round.
        "computed_max_over_mean_worst_round": max(
            [v or 0.0 for v in other.get("computed_tokens_max_over_mean_per_round", [])],
            default=None,
        ),
    }


def judged(workload: str, figures: dict[str, Any]) -> dict[str, bool]:
    """Which of the issue's targets a workload has, each met or not (figures: versus())."""
    gain, drop = figures["hit_ratio_gain"], figures["ttft_p50_drop"]
    if workload in HIT_WORKLOADS:
        return {
            "hit_ratio_met": gain is not None and gain >= HIT_RATIO_GAIN,
            "ttft_p50_met": drop is not None and drop >= TTFT_P50_DROP,
        }
    if workload == "uniform":
        tokens = figures["tokens_per_second_ratio"]
        return {
            # No more than the band slower (faster is no failure).
            "tokens_per_second_met": tokens is not None and tokens >= 1 - TOKENS_PER_SECOND_BAND
        }
    if workload == "skewed":
        p99 = figures["ttft_p99_ratio"]
        work = figures["computed_max_over_mean_worst_round"]
        return {
            "balance_met": figures["requests_max_over_mean_worst_round"] <= MAX_OVER_MEAN,
            "work_balance_met": work is not None and work <= MAX_OVER_MEAN,
            "ttft_p99_met": p99 is not None and p99 <= 1.0,
        }
    return {}


def targets(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Every policy's rows against least_request's of the same workload: by workload and
    policy, the ratios and each of the issue's targets, met or not."""
    by = {(r["workload"], r["policy"]): r for r in rows}
    verdicts: dict[str, dict[str, dict[str, Any]]] = {}
    for (workload, policy), other in by.items():
        baseline = by.get((workload, BASELINE))
        if policy == BASELINE or baseline is None:
            continue
        figures = versus(baseline, other)
        verdicts.setdefault(workload, {})[policy] = {**figures, **judged(workload, figures)}
    return verdicts


async def prefill_probe(address: str, prompts: list[str]) -> dict[str, float]:
    """TTFT of each prompt sent to one worker twice, one token asked (the first time its
    prefill is computed, the second time its full blocks come from the prefix cache): the
    median of each, in ms."""
    misses: list[float] = []
    hits: list[float] = []
    async with WorkerTarget(address) as target:
        for prompt in prompts:
            for times in (misses, hits):
                started = time.perf_counter()
                first, *_rest = await one_request(target, RequestSpec(0, prompt, 1), 60.0)
                if first is not None:
                    times.append((first - started) * 1e3)
    return {
        "uncached_ms": round(sorted(misses)[len(misses) // 2], 1) if misses else -1.0,
        "cached_ms": round(sorted(hits)[len(hits) // 2], 1) if hits else -1.0,
    }


def prefill_times(local_mesh: LocalMesh, count: int) -> dict[str, Any]:
    """Each worker's prefill time of a ~1,000-token prompt, uncached and cached (the model's
    own figure; the prompts are made for this and used nowhere else)."""
    workload = Workload(
        Lengths.parse(str(PREFIX_WORDS + 16)), Lengths.parse("1"), seed=1, text_seed=777
    )
    found: dict[str, Any] = {}
    prompts = iter(workload.requests())
    for program in local_mesh.replicas("worker"):
        batch = [request.prompt for request in islice(prompts, count)]
        found[program.name] = asyncio.run(prefill_probe(program.address, batch))
    return found


def check_prefixes_outrun_the_key() -> None:
    """Every prefix is longer than the gateway's affinity key (its first characters), so the
    key is the prefix's alone and a request's own suffix plays no part in it."""
    key = GatewaySettings().affinity_prefix_chars
    sample = Workload(
        Lengths.parse("1"), Lengths.parse("1"), 1, prefixes=64, prefix_words=PREFIX_WORDS
    )
    shortest = min(len(prefix) for prefix in sample.shared_prefixes())
    if shortest <= key:
        raise SystemExit(f"prefixes of {shortest} characters do not outrun the {key}-character key")


def wait_for_workers(admin_port: int, workers: int, seconds: float = 60.0) -> None:
    """Until the Envoy at admin_port sees every worker healthy."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        hosts = envoy_hosts(admin_port).get("worker", [])
        if sum(healthy for _, healthy in hosts) >= workers:
            return
        time.sleep(0.5)
    raise SystemExit(f"the Envoy at admin port {admin_port} has no {workers} healthy workers")


def markdown(rows: list[dict[str, Any]], verdicts: dict[str, Any], notes: dict[str, Any]) -> str:
    policies = ", ".join(notes["policies"])
    lines = [
        f"# Prefix-aware routing: {policies} (issue #19)\n",
        f"Model {notes['model']} ({notes['worker_dtype']}; KV cache of "
        f"{notes['kv_capacity_tokens']:,} tokens a worker), {WORKERS} workers (an engine on "
        f"each core), 1 gateway, direct token path; {notes['rounds']} interleaved rounds of "
        f"{notes['round_seconds']:g} s (pressure: as its plan says) per policy and workload, "
        f"open loop (Poisson); prefixes of {PREFIX_WORDS} words (~{notes['prefix_tokens']:.0f} "
        f"tokens), suffixes of {SUFFIX_WORDS} words, {OUTPUT_TOKENS} tokens out. Prefill of a "
        f"~1,000-token prompt on each worker (uncached / cached, ms): "
        + ", ".join(
            f"{name} {times['uncached_ms']} / {times['cached_ms']}"
            for name, times in notes["prefill"].items()
        )
        + ".\n",
        "Workloads: "
        + "; ".join(f"{plan['name']} {plan['what']}, {plan['rate']:g}/s" for plan in notes["plans"])
        + ".\n",
        "Picker settings: "
        + (
            ", ".join(f"{k}={v}" for k, v in sorted(notes.get("picker_environment", {}).items()))
            or "the gateway's defaults"
        )
        + ".\n",
        (
            f"Through the edge's stream relay (stream_relay): {', '.join(notes['relayed'])}.\n"
            if notes.get("relayed")
            else ""
        ),
        "Best possible: the hit ratio of one prefix cache of unbounded size that saw every "
        "request in the order sent, the most any routing could reach.\n",
        "| workload | policy | rate/s | req | err | hit ratio | best possible | TTFT p50 / p99 ms "
        "| tokens/s | worker request shares | max/mean | computed-token shares | "
        "Envoy endpoint shares |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['policy']} | {r['rate']:g} | {r['requests']} | "
            f"{r['errors']} | {r['hit_ratio']} | {_figure(r.get('best_hit_ratio'), 'g')} | "
            f"{r['ttft_ms']['p50_ms']:.0f} / "
            f"{r['ttft_ms']['p99_ms']:.0f} | {r['tokens_per_second']:.1f} | "
            f"{_shares(r['request_shares'])} | {r['requests_max_over_mean']} | "
            f"{_shares(r['computed_token_shares'])} | {_shares(r['envoy_endpoint_shares'])} |"
        )
    lines += [
        "",
        f"## Against {BASELINE}\n",
        "Hit ratio, TTFT p99 and tokens/s as ratios to least_request's; TTFT p50 as the share it "
        "is lower by; the busiest worker's requests, and prompt tokens computed, over the mean "
        "in the worst round; the workload's targets, met or not.\n",
        "| workload | policy | hit ratio x | TTFT p50 lower | TTFT p99 x | tokens/s x | "
        "max/mean, worst round | computed max/mean, worst round | targets |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, by_policy in verdicts.items():
        for policy, v in by_policy.items():
            met = "; ".join(
                f"{TARGETS[key]}: {'yes' if v[key] else 'NO'}" for key in TARGETS if key in v
            )
            lines.append(
                f"| {workload} | {policy} | {_figure(v['hit_ratio_gain'])} | "
                f"{_figure(v['ttft_p50_drop'], '.0%')} | {_figure(v['ttft_p99_ratio'])} | "
                f"{_figure(v['tokens_per_second_ratio'])} | "
                f"{v['requests_max_over_mean_worst_round']:g} | "
                f"{_figure(v['computed_max_over_mean_worst_round'], 'g')} | {met or 'none'} |"
            )
    lines += [
        "",
        "CPU per request (ms) of each process:\n",
        "| workload | policy | " + " | ".join(sorted(rows[0]["cpu"])) + " |",
        "|---|---|" + "---|" * len(rows[0]["cpu"]),
    ]
    for r in rows:
        costs = " | ".join(str(r["cpu"][name]["ms_per_request"]) for name in sorted(r["cpu"]))
        lines.append(f"| {r['workload']} | {r['policy']} | {costs} |")
    lines += ["", "Hit ratio per round:\n"]
    for r in rows:
        lines.append(f"- {r['workload']} {r['policy']}: {r['hit_ratio_per_round']}")
    return "\n".join(lines) + "\n"


def _figure(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def _shares(values: dict[str, float]) -> str:
    return " / ".join(f"{value:.0%}" for _, value in sorted(values.items())) or "n/a"


def open_edges(stack: ExitStack, local_mesh: LocalMesh, policies: Sequence[str]) -> list[Edge]:
    """An Envoy in `stack` for each policy, least_request's too, each started and placed
    alike (the mesh's own Envoy, under supervisord, would be scheduled unlike the others);
    a policy ending in RELAYED routes through the edge's stream relay."""
    if not local_mesh.settings.direct_token_path:
        raise SystemExit("the mesh must route on the direct token path")
    edges = []
    for policy in policies:
        envoy, pid = stack.enter_context(
            second_envoy(
                local_mesh,
                local_mesh.run_dir,
                worker_routing=routing_of(policy),
                stream_relay=policy.endswith(RELAYED),
            )
        )
        edges.append(Edge(policy, f"127.0.0.1:{envoy.edge_port}", envoy.admin_port, pid))
    for edge in edges:
        wait_for_workers(edge.admin_port, WORKERS)
    return edges


def uncached_ms(prefill: dict[str, Any]) -> float:
    """The workers' mean prefill time of a ~1,000-token prompt, uncached."""
    times = [float(times["uncached_ms"]) for times in prefill.values()]
    if not times or min(times) <= 0:
        raise SystemExit(f"no prefill time measured on every worker: {prefill}")
    return sum(times) / len(times)


def run_plan(
    plan: Plan,
    edges: list[Edge],
    mesh: Mesh,
    best: BestCache,
    rounds: int,
    seconds: float,
    cpus: str,
) -> dict[str, list[dict[str, Any]]]:
    """Every edge's rounds of one workload, in rotating order; each round's result by policy."""
    runs: dict[str, list[dict[str, Any]]] = {edge.policy: [] for edge in edges}
    for number in range(rounds):
        for edge in rotation(edges, number):
            seed = 100 * (WORKLOADS.index(plan.name) + 1) + number
            text_seed = 10 * seed + CHOICES.index(edge.policy) + 1
            config = replace(plan.config(edge, plan.seconds or seconds, seed, text_seed), cpus=cpus)
            result = measured_round(config, edge, mesh, best)
            runs[edge.policy].append(result)
            print(
                f"[{SCENARIO}] {config.label} ({number + 1}/{rounds}): "
                f"{result['requests']} requests, {result['errors']} errors, hit ratio "
                f"{result['prefix']['hit_ratio']} (best {result['prefix']['best_hit_ratio']}), "
                "TTFT p50/p99 "
                f"{result['ttft_ms']['p50_ms']:.0f}/{result['ttft_ms']['p99_ms']:.0f} ms,"
                f" shares {result['prefix']['request_shares']}",
                file=sys.stderr,
                flush=True,
            )
    return runs


def prefix_routing(
    bench: Bench,
    rounds: int,
    model: str = SMALL_MODEL,
    workloads: Sequence[str] = DEFAULT_WORKLOADS,
    policies: Sequence[str] = POLICIES,
) -> dict[str, Any]:
    """Every workload through every policy's edge in interleaved rounds; the report's
    figures."""
    if BASELINE not in policies:
        raise SystemExit(f"every policy is set against {BASELINE}: measure it too")
    if not (ROOT / model / "config.json").is_file():
        raise SystemExit(f"no model at {model} (make small-model, make pressure-model)")
    check_prefixes_outrun_the_key()
    out = bench.out / SCENARIO
    seconds = 8.0 if bench.quick else 30.0
    tokenizer = Tokenizer.from_file(str(ROOT / model / "tokenizer.json"))
    tokens = prefix_tokens(tokenizer)
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        local_mesh = stack.enter_context(
            private_mesh(
                workers=WORKERS,
                model=model,
                worker_dtype=WORKER_DTYPE,
                # The gateways name workers for the picker's Envoy (the others ignore them).
                picker_feed=any(routing_of(policy) == "picker" for policy in policies),
            )
        )
        edges = open_edges(stack, local_mesh, policies)
        mesh = Mesh(local_mesh)
        capacity = mesh.kv_capacity()
        best = BestCache(tokenizer, mesh.block_size())
        prefill = prefill_times(local_mesh, 3 if bench.quick else 5)
        print(
            f"[{SCENARIO}] KV cache {capacity:,} tokens a worker, prefixes of ~{tokens:.0f} "
            f"tokens; prefill: {prefill}",
            file=sys.stderr,
            flush=True,
        )
        chosen = {plan.name: plan for plan in plans()}
        if "pressure" in workloads:
            uses = PRESSURE_USES_QUICK if bench.quick else PRESSURE_USES
            chosen["pressure"] = pressure_plan(capacity, tokens, uncached_ms(prefill), uses)
        selected = [chosen[name] for name in workloads]
        # Off the engines' cores where the machine has any to spare (a 2-core one has not).
        cpus = local_mesh.mesh_cores(WORKERS, os.cpu_count() or 1)
        for edge in edges:  # the engines' first batches of each shape, not measured
            warm = plans()[0].config(edge, 3.0, seed=999, text_seed=999)
            run(replace(warm, cpus=cpus, label=f"warm-up {edge.policy}"), show_progress=False)
        for plan in selected:
            runs = run_plan(plan, edges, mesh, best, rounds, seconds, cpus)
            results = []
            for edge in edges:
                total = combined(runs[edge.policy])
                bench._record(SCENARIO, total)
                results.append(total)
                rows.append(row(plan, edge.policy, total))
            report.plot_cdfs(
                results, "ttft", out / f"{plan.name}-ttft-cdf.png", f"TTFT: {plan.name}"
            )
    verdicts = targets(rows)
    notes = {
        "model": model,
        "worker_dtype": WORKER_DTYPE,
        # The gateways' picker settings given to this run (the defaults otherwise).
        "picker_environment": {
            name: value
            for name, value in os.environ.items()
            if name.startswith("TOKENMESH_GATEWAY_PICKER__")
        },
        "workers": WORKERS,
        "policies": list(policies),
        # The policies whose edge routed through the stream relay.
        "relayed": [policy for policy in policies if policy.endswith(RELAYED)],
        "rounds": rounds,
        "round_seconds": seconds,
        "kv_capacity_tokens": capacity,
        "prefix_words": PREFIX_WORDS,
        "prefix_tokens": round(tokens, 1),
        "suffix_words": SUFFIX_WORDS,
        "output_tokens": OUTPUT_TOKENS,
        "prefill": prefill,
        "plans": [vars(plan) for plan in selected],
        "generator_cpus": cpus or "any",
        "machine": {"cpus": os.cpu_count(), **report.processor()},
        "load_average_at_end": [round(v, 2) for v in os.getloadavg()],
    }
    summary = {"notes": notes, "rows": rows, "targets": verdicts}
    report.write_json(summary, out / "summary.json")
    (out / "summary.md").write_text(markdown(rows, verdicts, notes))
    return {"rows": rows, "targets": verdicts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short rounds (a smoke test)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per policy")
    parser.add_argument("--out", type=Path, default=None, help="result directory")
    parser.add_argument("--model", default=SMALL_MODEL, help="the workers' model directory")
    parser.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help=f"comma-separated, of {','.join(WORKLOADS)}",
    )
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=(
            f"comma-separated, of {','.join(CHOICES)}: worker_routing policies, through "
            f"Envoy's router or ({RELAYED}) the edge's stream relay"
        ),
    )
    args = parser.parse_args()
    try:
        workloads = selection(args.workloads, WORKLOADS)
        policies = selection(args.policies, CHOICES)
    except ValueError as error:
        parser.error(str(error))
    stamp = datetime.now(UTC).strftime("%Y-%m-%d")
    bench = Bench(args.out or RESULTS / (stamp + ("-quick" if args.quick else "")), args.quick)
    prefix_routing(bench, 1 if args.quick else args.rounds, args.model, workloads, policies)
    print((bench.out / SCENARIO / "summary.md").read_text())
    print(f"results in {bench.out / SCENARIO}", file=sys.stderr)


if __name__ == "__main__":
    main()
