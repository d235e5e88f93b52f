"""The load generator's engine: closed loop (fixed concurrency) or open loop (Poisson arrivals
at a fixed rate), each request's TTFT, inter-token gaps, end-to-end latency, tokens and status
recorded into HDR histograms. Runs in its own processes (spawned, uvloop), merges their
histograms and reports the generator's own CPU use."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import resource
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Barrier as BarrierType
from typing import Any

from loadtests.stats import Latencies
from loadtests.targets import Message, Target, make_target, status_of
from loadtests.wire import ByteCounter
from loadtests.workload import Lengths, RequestSpec, Workload, poisson_arrivals

# A generator process busier than this (share of one core) may be what limits the figures.
SATURATED_CPU = 0.9
# The longest a generator process waits for the others to be ready to send (spawning and
# importing on a saturated core takes seconds).
START_BARRIER_SECONDS = 120.0
# Per-request records kept for the timeline (plots, phases); percentiles never come from it.
TIMELINE_LIMIT = 20_000
# The generator's scheduling priority (a nice value), for its session's group and itself.
GENERATOR_NICE = -10


@dataclass(frozen=True)
class RunConfig:
    target: str  # a kind from loadtests.targets.KINDS
    address: str
    mode: str = "closed"  # closed | open
    concurrency: int = 8
    rate: float = 10.0  # requests/s, open loop
    duration: float = 10.0  # seconds of measurement after the warm-up
    requests: int = 1000  # most measured requests
    warmup: float = 2.0  # seconds; requests started in it are not measured
    prompt_words: str = "16"
    output_tokens: str = "64"
    seed: int = 1
    processes: int = 1
    timeout: float = 120.0  # per request
    documents: int = 0
    model: str = ""  # the openai target's model name
    stream_interval: int = 0  # the llm target's: tokens per message at least (0: each at once)
    count_bytes: bool = False
    # Streams that read one message every slow_interval seconds, beside the measured load.
    slow_streams: int = 0
    slow_interval: float = 1.0
    slow_tokens: int = 16  # tokens each slow stream asks for
    # The cores the generator may use ("1", "2-7"; empty: any): off the engines' cores.
    cpus: str = ""
    label: str = ""
    # Shared prefixes (Workload): prompts start with one of `prefixes` prefixes of prefix_words
    # words, prefix 0 taking prefix_share of them (0: all alike); prompt_words is the suffix.
    prefixes: int = 0
    prefix_words: int = 0
    prefix_share: float = 0.0
    # The prompts' words' seed (0: seed): same arrivals and lengths, different text.
    text_seed: int = 0
    # The openai target's: a JSON schema (as text) every answer must follow (vLLM's
    # structured_outputs.json, which the mesh and vLLM's server both take); "": plain text.
    structured_json: str = ""
    # gRPC targets: connections each generator process spreads its streams over (a server's
    # processes that share a port, SO_REUSEPORT, are spread by connection).
    connections: int = 1
    # llm target: each request carries an x-request-id of its own, and the result lists each
    # measured request's first message as (request id, sent, first message read, the worker's
    # emitted_unix_nanos), in wall-clock ns (loadtests/first_token_stages.py).
    request_ids: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode is closed or open, not {self.mode!r}")
        if self.processes < 1 or self.concurrency < 1 or self.requests < 1:
            raise ValueError("processes, concurrency and requests must be at least 1")
        if self.duration <= 0 or self.warmup < 0 or self.timeout <= 0:
            raise ValueError("duration and timeout must be positive, warmup not negative")
        self.workload()  # the lengths and the prefixes' settings, checked

    def workload(self) -> Workload:
        return Workload(
            Lengths.parse(self.prompt_words),
            Lengths.parse(self.output_tokens),
            self.seed,
            self.documents,
            self.prefixes,
            self.prefix_words,
            self.prefix_share,
            self.text_seed,
        )

    def shard(self, index: int) -> tuple[int, float, int]:
        """This process's (concurrency, rate, request budget)."""
        n = self.processes
        share = self.concurrency // n + (1 if index < self.concurrency % n else 0)
        budget = self.requests // n + (1 if index < self.requests % n else 0)
        return max(share, 1), self.rate / n, max(budget, 1)


@dataclass
class Recorder:
    """What one process measured."""

    ttft: Latencies = field(default_factory=Latencies)
    itl: Latencies = field(default_factory=Latencies)
    e2e: Latencies = field(default_factory=Latencies)
    # Gaps between the worker's emission times of consecutive tokens (tokenmesh targets).
    server_itl: Latencies = field(default_factory=Latencies)
    # Open loop: how late each request left against its Poisson schedule (a busy generator).
    send_lag: Latencies = field(default_factory=Latencies)
    status: Counter[str] = field(default_factory=Counter)
    tokens: int = 0
    warmup_requests: int = 0
    first_start: float = float("inf")
    last_end: float = 0.0
    # (start offset s, TTFT s or -1, e2e s, status, first warning) per measured request.
    timeline: list[tuple[float, float, float, str, str]] = field(default_factory=list)
    slow_status: Counter[str] = field(default_factory=Counter)
    slow_tokens: int = 0
    # Every token received, warm-up and slow streams included (the byte count's denominator).
    all_tokens: int = 0
    # Every message that carried tokens, likewise (a message may carry several).
    all_messages: int = 0
    # (request id, sent ns, first message ns, its emitted ns) per measured request that
    # carried its own id (RunConfig.request_ids), wall clock.
    firsts: list[tuple[str, int, int, int]] = field(default_factory=list)

    def record(
        self,
        start: float,
        first: float | None,
        gaps: list[float],
        end: float,
        tokens: int,
        status: str,
        warning: str,
        origin: float,
    ) -> None:
        self.status[status] += 1
        self.first_start = min(self.first_start, start)
        self.last_end = max(self.last_end, end)
        if status == "OK":
            self.tokens += tokens
            if first is not None:
                self.ttft.record(first - start)
            for gap in gaps:
                self.itl.record(gap)
            self.e2e.record(end - start)
        if len(self.timeline) < TIMELINE_LIMIT:
            ttft = first - start if first is not None else -1.0
            self.timeline.append(
                (round(start - origin, 4), round(ttft, 6), round(end - start, 6), status, warning)
            )


async def one_request(
    target: Target,
    spec: RequestSpec,
    limit: float,
    slow_interval: float = 0.0,
    server_gaps: list[float] | None = None,
    first_message: list[Message] | None = None,
) -> tuple[float | None, list[float], float, int, str, str, int]:
    """Stream one request: (first message time, gaps between messages, end time, tokens,
    status, first warning, messages that carried tokens). Times are time.perf_counter()
    values. server_gaps, when given, gets the gaps between the worker's emission times
    (tokenmesh targets): what the client's gaps would be with no transport in between.
    first_message, when given, gets the first message that carried tokens."""
    first: float | None = None
    emitted = 0
    previous = 0.0
    gaps: list[float] = []
    tokens = 0
    warning = ""
    status = "OK"
    messages = 0
    try:
        async with asyncio.timeout(limit):
            message: Message
            async for message in target.stream(spec, limit):
                tokens += message.tokens
                if not message.arrival:
                    continue
                messages += 1
                now = time.perf_counter()
                if first is None:
                    first, warning = now, message.warning
                    if first_message is not None:
                        first_message.append(message)
                else:
                    gaps.append(now - previous)
                # A message of several tokens: the ones after its first came at no gap.
                together = [0.0] * (message.tokens - 1)
                gaps.extend(together)
                previous = now
                if server_gaps is not None and message.emitted_ns:
                    if emitted:
                        server_gaps.append(max(message.emitted_ns - emitted, 0) / 1e9)
                    server_gaps.extend(together)
                    emitted = message.emitted_ns
                if slow_interval:
                    await asyncio.sleep(slow_interval)
    except Exception as error:  # every failure is counted by its status, none stops the run
        status = status_of(error)
    return first, gaps, time.perf_counter(), tokens, status, warning, messages


async def run_shard(
    config: RunConfig,
    index: int,
    progress: Synchronized[int] | None = None,
    start: BarrierType | threading.Barrier | None = None,
) -> dict[str, Any]:
    """One process's part of the run; its histograms come back encoded. start: the barrier
    every process of the run passes before its clock starts, so that all of them send their
    load at once (a process spawned late on a busy core would otherwise run part of its load
    alone, at a lower concurrency than the run's)."""
    concurrency, rate, budget = config.shard(index)
    requests: Iterator[RequestSpec] = config.workload().requests(index)
    recorder = Recorder()
    counter = ByteCounter(config.address) if config.count_bytes else None
    address = config.address
    if counter is not None:
        await counter.start()
        address = counter.address
    if start is not None:
        await asyncio.to_thread(start.wait, START_BARRIER_SECONDS)
    usage_before = resource.getrusage(resource.RUSAGE_SELF)
    origin = time.perf_counter()
    origin_unix = time.time()
    measure_from = origin + config.warmup
    stop_at = measure_from + config.duration
    measured = 0

    def done() -> bool:
        return measured >= budget or time.perf_counter() >= stop_at

    def admit(start: float) -> bool:
        """Whether a request sent at `start` is measured (counted against the budget now,
        before it runs, so the bound holds however many are in flight)."""
        nonlocal measured
        counted = start >= measure_from
        measured += counted
        return counted

    async def run(spec: RequestSpec, start: float, counted: bool) -> None:
        server_gaps: list[float] = []
        first_message: list[Message] = []
        if config.request_ids:
            spec = replace(spec, request_id=uuid.uuid4().hex)
        # The wall clock beside the monotonic one: the first message's time joins Envoy's
        # and the worker's (request_ids).
        sent_ns, sent = time.time_ns(), time.perf_counter()
        first, gaps, end, tokens, status, warning, messages = await one_request(
            target, spec, config.timeout, server_gaps=server_gaps, first_message=first_message
        )
        recorder.all_tokens += tokens
        recorder.all_messages += messages
        if counted:
            recorder.record(start, first, gaps, end, tokens, status, warning, measure_from)
            if status == "OK":
                for gap in server_gaps:
                    recorder.server_itl.record(gap)
            if (
                spec.request_id
                and status == "OK"
                and first is not None
                and first_message
                and len(recorder.firsts) < TIMELINE_LIMIT
            ):
                first_ns = sent_ns + round((first - sent) * 1e9)
                recorder.firsts.append(
                    (spec.request_id, sent_ns, first_ns, first_message[0].emitted_ns)
                )
            if progress is not None:
                with progress.get_lock():
                    progress.value += 1
        else:
            recorder.warmup_requests += 1

    async def closed_user() -> None:
        while not done():
            start = time.perf_counter()
            await run(next(requests), start, admit(start))

    async def open_loop() -> None:
        tasks: set[asyncio.Task[None]] = set()
        for at in poisson_arrivals(rate, config.seed, index):
            scheduled = origin + at
            if scheduled >= stop_at or done():
                break
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if scheduled >= measure_from:
                recorder.send_lag.record(max(time.perf_counter() - scheduled, 0.0))
            # Latency counts from the scheduled send time: a late send is the system's
            # (or the generator's) delay, not hidden by coordinated omission.
            task = asyncio.create_task(run(next(requests), scheduled, admit(scheduled)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)

    async def slow_reader(i: int) -> None:
        spec = replace(next(requests), max_tokens=config.slow_tokens)
        _first, _gaps, _end, tokens, status, _warning, messages = await one_request(
            target, spec, config.timeout, config.slow_interval
        )
        recorder.slow_status[status] += 1
        recorder.slow_tokens += tokens
        recorder.all_tokens += tokens
        recorder.all_messages += messages

    target = make_target(
        config.target,
        address,
        config.documents,
        config.model,
        config.stream_interval,
        config.structured_json,
        config.connections,
    )
    async with target:
        slow = [asyncio.create_task(slow_reader(i)) for i in range(config.slow_streams)]
        if config.mode == "closed":
            await asyncio.gather(*(closed_user() for _ in range(concurrency)))
        else:
            await open_loop()
        await asyncio.gather(*slow)
    wall = time.perf_counter() - origin
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (usage.ru_utime - usage_before.ru_utime) + (usage.ru_stime - usage_before.ru_stime)
    if counter is not None:
        await counter.stop()
    return {
        "ttft": recorder.ttft.encode(),
        "itl": recorder.itl.encode(),
        "e2e": recorder.e2e.encode(),
        "server_itl": recorder.server_itl.encode(),
        "send_lag": recorder.send_lag.encode(),
        "status": dict(recorder.status),
        "tokens": recorder.tokens,
        "warmup_requests": recorder.warmup_requests,
        "window": [recorder.first_start - origin, recorder.last_end - origin],
        "timeline": recorder.timeline,
        "slow_status": dict(recorder.slow_status),
        "slow_tokens": recorder.slow_tokens,
        "cpu_fraction": round(cpu / wall, 3),
        "rss_bytes": usage.ru_maxrss * 1024,
        "placement": _placement(),
        "bytes_sent": counter.sent if counter else None,
        "bytes_received": counter.received if counter else None,
        "all_tokens": recorder.all_tokens,
        "all_messages": recorder.all_messages,
        "firsts": recorder.firsts,
        # Offsets (window, timeline) count from this shard's start; shards start together
        # (run's barrier), and merge places their windows by it.
        "started_unix": origin_unix,
    }


_progress: Synchronized[int] | None = None
_start: BarrierType | None = None


def _init_shard(progress: Synchronized[int], start: BarrierType, cpus: str) -> None:
    global _progress, _start
    _progress = progress
    _start = start
    stand_apart(cpus)


def cpu_set(cpus: str) -> set[int]:
    """The cores of a list like taskset's ("1", "0,2", "2-7")."""
    cores: set[int] = set()
    for part in filter(None, cpus.split(",")):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def stand_apart(cpus: str = "") -> None:
    """Put this generator process ahead of the servers it measures, as a client on a machine of
    its own would be: in a session of its own (Linux schedules each session as one group, and a
    nice value counts only inside its group) with a raised priority, for the group and for the
    process. Without it, a generator that shares saturated cores with the servers reads their
    answers late, and its TTFT measures the scheduler, not the servers. Where a step is not
    permitted the generator runs as it is; each result says how it ran (placement). Given
    cores, it keeps to them (off the engines' cores, which a remote client does not share)."""
    if cpus:
        os.sched_setaffinity(0, cpu_set(cpus))
    with contextlib.suppress(OSError):
        os.setsid()
    with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as group:
        group.write(str(GENERATOR_NICE))
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, GENERATOR_NICE)


def _placement() -> str:
    """The generator's session and priority as the scheduler has them."""
    group = "no autogroup"
    with contextlib.suppress(OSError), open("/proc/self/autogroup") as autogroup:
        group = autogroup.read().strip()
    session = "own session" if os.getsid(0) == os.getpid() else "the caller's session"
    cores = ",".join(str(core) for core in sorted(os.sched_getaffinity(0)))
    return f"{session}, {group}, nice {os.getpriority(os.PRIO_PROCESS, 0)}, cores {cores}"


def shard_main(config: RunConfig, index: int) -> dict[str, Any]:
    """Entry point of a generator process."""
    import uvloop

    return uvloop.run(run_shard(config, index, _progress, _start))


def merge(config: RunConfig, shards: list[dict[str, Any]], started: datetime) -> dict[str, Any]:
    """One result from every process's histograms and counters."""
    histograms = {name: Latencies() for name in ("ttft", "itl", "e2e", "server_itl", "send_lag")}
    status: Counter[str] = Counter()
    slow_status: Counter[str] = Counter()
    for shard in shards:
        for name, latencies in histograms.items():
            latencies.merge(Latencies.decode(shard[name]))
        status.update(shard["status"])
        slow_status.update(shard["slow_status"])
    tokens = sum(shard["tokens"] for shard in shards)
    # Each shard's window on the wall clock: from the first measured request's start to the
    # last one's end over every shard.
    windows = [
        [shard["started_unix"] + offset for offset in shard["window"]]
        for shard in shards
        if shard["window"][1] > 0
    ]
    seconds = max(w[1] for w in windows) - min(w[0] for w in windows) if windows else 0.0
    starts = [shard["started_unix"] for shard in shards]
    cpu = [shard["cpu_fraction"] for shard in shards]
    sent = [shard["bytes_sent"] for shard in shards if shard["bytes_sent"] is not None]
    received = [shard["bytes_received"] for shard in shards if shard["bytes_received"] is not None]
    wire = None
    if sent:
        all_tokens = sum(shard["all_tokens"] for shard in shards)
        wire = {
            "sent": sum(sent),
            "received": sum(received),
            "tokens": all_tokens,
            "received_per_token": round(sum(received) / all_tokens, 1) if all_tokens else None,
            "counted_by": "byte-counting TCP relay in the generator, warm-up included",
        }
    return {
        "label": config.label,
        "config": asdict(config),
        "started_at": started.isoformat(timespec="seconds"),
        # Wall-clock time of the measurement's start (timeline offsets count from it).
        "measure_origin_unix": min(shard["started_unix"] for shard in shards) + config.warmup,
        "load_average_start": [round(v, 2) for v in os.getloadavg()],
        "generator": {
            "processes": config.processes,
            "cpu_fraction_per_process": cpu,
            "saturated": any(value > SATURATED_CPU for value in cpu),
            "max_rss_bytes": max(shard["rss_bytes"] for shard in shards),
            "placement": shards[0]["placement"],
            "send_lag_ms": histograms["send_lag"].percentiles(),
            # How far apart the processes began sending (run's start barrier: milliseconds).
            "start_spread_ms": round((max(starts) - min(starts)) * 1000, 1),
        },
        **figures(status, tokens, seconds, histograms),
        "warmup_requests": sum(shard["warmup_requests"] for shard in shards),
        # Every token the run received, warm-up and slow streams included (what the servers
        # spent their CPU on: the denominator of CPU per token).
        "tokens_received": sum(shard["all_tokens"] for shard in shards),
        "messages_received": sum(shard["all_messages"] for shard in shards),
        "wire_bytes": wire,
        "slow_streams": (
            {"status": dict(slow_status), "tokens": sum(s["slow_tokens"] for s in shards)}
            if config.slow_streams
            else None
        ),
        "histograms": {
            name: histograms[name].encode() for name in ("ttft", "itl", "e2e", "server_itl")
        },
        "timeline": sorted(row for shard in shards for row in shard["timeline"]),
        "firsts": [row for shard in shards for row in shard["firsts"]],
    }


def figures(
    status: Counter[str], tokens: int, seconds: float, histograms: dict[str, Latencies]
) -> dict[str, Any]:
    """A result's counts, rates and latency percentiles, from its status counts, tokens,
    measured seconds and histograms."""
    measured = sum(status.values())
    return {
        "requests": measured,
        "status": dict(status),
        "errors": measured - status.get("OK", 0),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 1) if seconds else 0.0,
        "requests_per_second": round(measured / seconds, 2) if seconds else 0.0,
        "ttft_ms": histograms["ttft"].percentiles(),
        "itl_ms": histograms["itl"].percentiles(),
        "e2e_ms": histograms["e2e"].percentiles(),
        "server_itl_ms": histograms["server_itl"].percentiles(),
    }


def run(config: RunConfig, show_progress: bool = True) -> dict[str, Any]:
    """Run the load in config.processes spawned generator processes; the merged result."""
    from tqdm import tqdm

    started = datetime.now(UTC)
    load_before = [round(v, 2) for v in os.getloadavg()]
    context = multiprocessing.get_context("spawn")
    progress: Synchronized[int] = context.Value("q", 0)
    start = context.Barrier(config.processes)
    with ProcessPoolExecutor(
        config.processes,
        mp_context=context,
        initializer=_init_shard,
        initargs=(progress, start, config.cpus),
    ) as pool:
        futures = [pool.submit(shard_main, config, i) for i in range(config.processes)]
        bar = tqdm(
            total=config.requests,
            desc=config.label or f"{config.target} {config.mode}",
            unit="req",
            # None: only on a terminal (a log file gets no carriage-return updates).
            disable=None if show_progress else True,
            leave=False,
        )
        with contextlib.closing(bar):
            deadline = time.monotonic() + config.warmup + config.duration + config.timeout + 120
            while not all(f.done() for f in futures) and time.monotonic() < deadline:
                time.sleep(0.2)
                bar.update(progress.value - bar.n)
        shards = [f.result(timeout=max(deadline - time.monotonic(), 1)) for f in futures]
    result = merge(config, shards, started)
    result["load_average_start"] = load_before
    result["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    return result


def combine(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several runs of the same configuration (rounds interleaved with other
    targets, so that each sees the same machine load): histograms merged, counts summed,
    tokens/s over the runs' summed measured time."""
    first = results[0]
    if len(results) == 1:
        return first
    histograms = {name: Latencies() for name in ("ttft", "itl", "e2e", "server_itl")}
    status: Counter[str] = Counter()
    for result in results:
        for name, latencies in histograms.items():
            latencies.merge(Latencies.decode(result["histograms"][name]))
        status.update(result["status"])
    seconds = sum(r["seconds"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    cpu = [value for r in results for value in r["generator"]["cpu_fraction_per_process"]]
    wires = [r["wire_bytes"] for r in results if r["wire_bytes"]]
    wire = None
    if wires:
        sent, received = sum(w["sent"] for w in wires), sum(w["received"] for w in wires)
        counted = sum(w["tokens"] for w in wires)
        wire = {
            **wires[0],
            "sent": sent,
            "received": received,
            "tokens": counted,
            "received_per_token": round(received / counted, 1) if counted else None,
        }
    return {
        **first,
        "rounds": len(results),
        "load_average_start": first["load_average_start"],
        "load_average_end": results[-1].get("load_average_end"),
        "load_average_per_round": [r["load_average_start"] for r in results],
        "generator": {
            **first["generator"],
            "cpu_fraction_per_process": cpu,
            "saturated": any(value > SATURATED_CPU for value in cpu),
        },
        **figures(status, tokens, seconds, histograms),
        "warmup_requests": sum(r["warmup_requests"] for r in results),
        "tokens_received": sum(r["tokens_received"] for r in results),
        "messages_received": sum(r["messages_received"] for r in results),
        "wire_bytes": wire,
        "histograms": {name: latencies.encode() for name, latencies in histograms.items()},
        "timeline": [row for r in results for row in r["timeline"]][:TIMELINE_LIMIT],
        "firsts": [row for r in results for row in r.get("firsts", [])],
    }
