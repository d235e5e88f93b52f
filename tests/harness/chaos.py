"""The chaos scenarios: real faults (signals to real processes, a stopped control plane) under
bounded traffic through a running mesh's edge, one result row per scenario. `make chaos`
(loadtests/chaos.py) runs them in full on meshes of their own, tests/integration/test_chaos*.py
in their short versions. Every scenario leaves the mesh as it found it (killed programs
restarted and healthy in Envoy). All traffic goes to 127.0.0.1; every request has a deadline and
a hard bound, every wait and loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import psutil
import yaml
from grpc import aio

from tests.support import engine_cores, process_tree
from tokenmesh.common.tokens import WORKER_GENERATE, token_count
from tokenmesh.localmesh.mesh import LocalMesh, Program, envoy_host_statuses
from tokenmesh.localmesh.probes import engine_empty_at, fetch_text, series_values
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, llm_pb2, llm_pb2_grpc

OK = "OK"
HUNG = "HUNG"
# More than one Token message's bytes on the wire (a message of one token is about 30 bytes).
TOKEN_BYTES = 64
# A stream's answer headers and its first few tokens, as the edge sends them to a client.
CLIENT_BYTES = 4 * TOKEN_BYTES
# The workers' Generate, as their grpc_server_* metrics label it.
_SERVICE, _METHOD = WORKER_GENERATE.strip("/").split("/")
INFERENCE = {"grpc_service": _SERVICE, "grpc_method": _METHOD}
# A worker a scenario keeps busy can take seconds to answer a stats call or a metrics scrape
# (measured: over 5 s with 50 streams of 20 logprobs each on two cores).
BUSY_CALL_TIMEOUT_SECONDS = 30
# How long the kill's watcher waits for a worker's metrics before it looks again.
WATCH_CALL_TIMEOUT_SECONDS = 1.0
# A request still running this long after its own deadline is counted as hung (and cancelled).
HANG_MARGIN_SECONDS = 5.0
# A restarted worker loads vLLM again (~30 s idle, more on a busy 2-core box).
REJOIN_WITHIN_SECONDS = 300.0
# A client that never reads: a fixed 64 KiB window per stream (gRPC's BDP probing off).
STALLED_CLIENT_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65536)]
# worker_kill and envoy_restart hold some streams open until the kill: each reads its first
# token and no more until then, so flow control stops its worker's writes with the stream
# unfinished. With 20 alternatives per token a stream is ~680 KB, against the ~200 KB that the
# client's, Envoy's and the worker's windows take (docs/decisions/0004), so each worker holding
# one is in flight whenever the kill's watcher looks, however late (its looks went 14 s apart
# under load, as long as a burst of streams lives); Envoy's stream idle timeout (60 s) bounds
# the hold.
HELD_TOP_LOGPROBS = 20
HELD_TOKENS = 2000
# Envoy's counters of a cluster's retries: those made, those that got an answer, and those its
# retry budget refused (the request then fails with the attempt's error, flag UO).
RETRY_COUNTERS = ("upstream_rq_retry", "upstream_rq_retry_success", "upstream_rq_retry_overflow")
# What docs/failure-behaviour.md recommends to clients: retry UNAVAILABLE (nothing was
# generated yet when a call fails that way before its first token) with backoff, and wait for
# the channel to be ready.
RETRY_SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": "tokenmesh.v1.LLMService"}],
            "waitForReady": True,
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.1s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}
DOCUMENTS = (
    "Bananas are yellow.",
    "Paris is the capital of France.",
    "The sea is salty.",
    "Rome is in Italy.",
)


# The mesh's processes share one scheduling group (the kernel's autogroup of supervisord's
# session) and run at this nice while scenarios run: their clients' process, in a group of its
# own, otherwise went without a CPU for 2-14 s at a time under the scenarios' load on two cores
# (runnable all along, while the workers' engines ran), so requests looked hung and the kill's
# watcher looked late. A client stands for callers on other machines (docs/decisions/0005).
MESH_AUTOGROUP_NICE = 10


@contextlib.contextmanager
def clients_first(local_mesh: LocalMesh, nice: int = MESH_AUTOGROUP_NICE) -> Iterator[int | None]:
    """The mesh's autogroup at `nice` until the end (a task's own nice counts only within its
    group; raising a group's nice needs no privilege), then as it was; yields the nice it had
    (None where the kernel has no autogroups or the mesh is not running)."""
    pid = local_mesh.supervisord_pid()
    path = Path(f"/proc/{pid}/autogroup")
    try:
        previous = int(path.read_text().split()[-1]) if pid else None
        if previous is not None:
            path.write_text(str(nice))
    except (OSError, ValueError):
        previous = None
    try:
        yield previous
    finally:
        if previous is not None:
            with contextlib.suppress(OSError):  # the mesh stopped meanwhile
                path.write_text(str(previous))


@dataclass
class Outcome:
    """One request's end: OK, a status code name, or HUNG."""

    code: str
    tokens: int = 0
    degraded: bool = False
    seconds: float = 0.0
    first_token_seconds: float | None = None
    ended_unix_nanos: int = 0
    # time.monotonic() when it ended, and when its last token came.
    ended: float = 0.0
    last_token: float = 0.0
    details: str = ""
    # How many times the stream moved to another worker (its tokens' `resumed`), and how many
    # of its messages did not start where the one before had ended.
    resumed: int = 0
    gaps: int = 0
    # A moved stream's gap: from the message before its first resumed one to that one.
    gap_seconds: float | None = None


@dataclass
class Row:
    """One scenario's result: what was sent, how it ended, and what did not hold."""

    scenario: str
    sent: int = 0
    ok: int = 0
    degraded: int = 0
    # Of those ok, streams that moved to another worker on the way (resumed).
    moved: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    hung: int = 0
    max_recovery_seconds: float = 0.0
    # Measurements worth reading (seconds to leave Envoy's healthy set, ...).
    notes: dict[str, Any] = field(default_factory=dict)
    # One example message per failure code seen.
    examples: dict[str, str] = field(default_factory=dict)
    # Guarantees that did not hold; empty when the scenario passed.
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, outcomes: Sequence[Outcome]) -> None:
        for outcome in outcomes:
            self.sent += 1
            if outcome.code == OK:
                self.ok += 1
                self.degraded += outcome.degraded
                self.moved += bool(outcome.resumed)
            elif outcome.code == HUNG:
                self.hung += 1
            else:
                self.failed[outcome.code] = self.failed.get(outcome.code, 0) + 1
                self.examples.setdefault(outcome.code, outcome.details[:160])

    def check(self, holds: bool, guarantee: str) -> None:
        if not holds:
            self.violations.append(guarantee)

    def recovered(self, seconds: float) -> None:
        self.max_recovery_seconds = round(max(self.max_recovery_seconds, seconds), 2)

    @property
    def passed(self) -> bool:
        return not self.violations and not self.hung


def held_request(prompt: str) -> llm_pb2.GenerateRequest:
    """A stream larger than the windows of every hop (see HELD_TOP_LOGPROBS)."""
    return llm_pb2.GenerateRequest(
        prompt=prompt,
        max_tokens=HELD_TOKENS,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=HELD_TOP_LOGPROBS,
    )


def request(prompt: str, max_tokens: int, documents: Sequence[str] = ()) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        ignore_eos=True,
        documents=documents,
        top_k_documents=2 if documents else 0,
    )


async def generate(
    stub: llm_pb2_grpc.LLMServiceStub,
    message: llm_pb2.GenerateRequest,
    deadline: float,
    started: asyncio.Event | None = None,
    wait_for_ready: bool | None = None,
    hold: asyncio.Event | None = None,
) -> Outcome:
    """One Generate through the edge with a deadline `deadline` seconds away; HUNG if it is
    still running HANG_MARGIN_SECONDS after that (then it is cancelled). `started` is set on its
    first token; with `hold`, the rest is read only once hold is set (see HELD_TOP_LOGPROBS)."""
    begun = time.monotonic()
    outcome = Outcome(OK)
    call = stub.Generate(message, timeout=deadline, wait_for_ready=wait_for_ready)

    async def read() -> None:
        async for token in call:
            if outcome.tokens == 0:
                outcome.first_token_seconds = time.monotonic() - begun
                outcome.degraded = any(w.startswith("reranker_unavailable") for w in token.warnings)
                if started is not None:
                    started.set()
            count = token_count(token)
            if count and token.index != outcome.tokens:
                outcome.gaps += 1
            if token.resumed and outcome.gap_seconds is None:
                outcome.gap_seconds = time.monotonic() - outcome.last_token
            outcome.resumed = max(outcome.resumed, token.resumed)
            outcome.tokens += count
            outcome.last_token = time.monotonic()
            if hold is not None and not hold.is_set():
                await hold.wait()

    try:
        await asyncio.wait_for(read(), deadline + HANG_MARGIN_SECONDS)
    except TimeoutError:
        call.cancel()
        outcome.code = HUNG
    except aio.AioRpcError as err:
        outcome.code = err.code().name
        outcome.details = err.details() or ""
    else:
        if outcome.tokens != message.max_tokens or outcome.gaps:
            outcome.code = "INCOMPLETE"
            outcome.details = (
                f"{outcome.tokens} of {message.max_tokens} tokens, {outcome.gaps} gaps"
            )
    outcome.seconds = time.monotonic() - begun
    outcome.ended_unix_nanos = time.time_ns()
    outcome.ended = time.monotonic()
    return outcome


@dataclass(frozen=True)
class WorkerCount:
    """A worker's own count of its Generate streams (its grpc_server_* metrics): the token
    messages it has sent, and the streams it has not finished: those still generating and
    those whose writes wait for a slow reader (HTTP/2 flow control)."""

    messages: float
    unfinished: float

    @classmethod
    def of(cls, page: str) -> WorkerCount:
        started = sum(series_values(page, "grpc_server_started_total", **INFERENCE))
        handled = sum(series_values(page, "grpc_server_handled_total", **INFERENCE))
        return cls(
            messages=sum(series_values(page, "grpc_server_stream_msg_sent_total", **INFERENCE)),
            unfinished=started - handled,
        )


def envoy_sees_streams(
    streams: dict[str, int], received: int, sent: int | None, every: bool = True
) -> bool:
    """Envoy has streams open to every worker (every=False: to one at least), and more than a
    token's bytes per open stream came from the workers (and, with `sent`, a few tokens' bytes
    per stream left the edge)."""
    total = sum(streams.values())
    return (
        bool(streams)
        and (all(streams.values()) if every else any(streams.values()))
        and received >= TOKEN_BYTES * total
        and (sent is None or sent >= CLIENT_BYTES * total)
    )


def workers_generating(
    workers: Sequence[str],
    before: dict[str, WorkerCount],
    now: dict[str, WorkerCount],
    in_flight: bool,
) -> bool:
    """Every worker answered (it has sent token messages since `before`), and with in_flight
    every worker still has a stream it has not finished, whose kill cuts it: a worker that has
    written all its streams' tokens may still have them open at Envoy for slow readers, and
    its kill then ends none of them. A worker whose writes wait on flow control is in flight
    though it sends nothing meanwhile."""
    for name in workers:
        if name not in now or name not in before:
            return False  # not answering: asked again at the next look
        if now[name].messages <= before[name].messages:
            return False
        if in_flight and now[name].unfinished < 1:
            return False
    return True


class ScenarioMesh:
    """The running mesh as the scenarios see it: the edge, processes, and Envoy's view."""

    def __init__(self, local_mesh: LocalMesh) -> None:
        self.local_mesh = local_mesh
        self.edge = f"127.0.0.1:{local_mesh.settings.edge_port}"

    def healthy(self, cluster: str) -> set[str]:
        return {address for address, ok in self.local_mesh.envoy_hosts().get(cluster, []) if ok}

    def open_streams(self, cluster: str) -> dict[str, int]:
        """Streams Envoy has open to each host of the cluster (its rq_active gauge)."""
        streams: dict[str, int] = {}
        for name, address, host in envoy_host_statuses(self.local_mesh.settings.envoy_admin_port):
            if name == cluster:
                active = [s for s in host.get("stats", []) if s.get("name") == "rq_active"]
                # Protobuf JSON leaves out a zero value. A host removed and added again may be
                # listed twice for a while (the old one draining): both count.
                count = int(active[0].get("value", 0)) if active else 0
                streams[address] = streams.get(address, 0) + count
        return streams

    def known(self, cluster: str) -> set[str]:
        return {address for address, _ in self.local_mesh.envoy_hosts().get(cluster, [])}

    def channel(
        self, retries: bool = False, held: bool = False, own_connection: bool = False
    ) -> aio.Channel:
        """A channel to the edge; held: with fixed windows, for streams a scenario holds
        unread (a connection of their own, so they hold up no other stream). Channels with the
        same options share gRPC's connections; own_connection: one of its own, as another
        client's would be."""
        options: list[tuple[str, Any]] = list(STALLED_CLIENT_OPTIONS) if held else []
        if own_connection:
            options.append(("grpc.use_local_subchannel_pool", 1))
        if retries:
            options += [
                ("grpc.service_config", json.dumps(RETRY_SERVICE_CONFIG)),
                ("grpc.enable_retries", 1),
            ]
        return aio.insecure_channel(self.edge, options=options)

    def metric(self, program: Program, name: str, **labels: str) -> float:
        """Sum of the series name{labels} on one program's /metrics (0 when absent, or when
        the program does not answer)."""
        return sum(series_values(metrics_page(program), name, **labels))

    async def wait_until(
        self, condition: Callable[[], bool], within: float, every: float = 0.1
    ) -> float | None:
        """Seconds until condition() held, or None if it did not within `within`."""
        begun = time.monotonic()
        while time.monotonic() - begun < within:
            if await asyncio.to_thread(condition):
                return time.monotonic() - begun
            await asyncio.sleep(every)
        return None

    async def rejoined(self, program: Program, within: float = REJOIN_WITHIN_SECONDS) -> bool:
        """The program is back (supervisord restarted it if it died) and Envoy routes to it."""
        if self.local_mesh.ctl("status", program.name).stdout.split()[1:2] != ["RUNNING"]:
            self.local_mesh.ctl("start", program.name)
        cluster = program.service or ""
        took = await self.wait_until(lambda: program.address in self.healthy(cluster), within, 1)
        return took is not None

    def received_from(self, cluster: str) -> int:
        """Bytes Envoy has received from the cluster's hosts (its upstream_cx_rx_bytes_total)."""
        return self._envoy_counter(f"cluster.{cluster}.upstream_cx_rx_bytes_total")

    def sent_to_clients(self) -> int:
        """Bytes Envoy's edge has sent to its clients (downstream_cx_tx_bytes_total)."""
        return self._envoy_counter("http.edge.downstream_cx_tx_bytes_total")

    def _envoy_counter(self, stat: str) -> int:
        admin = f"http://127.0.0.1:{self.local_mesh.settings.envoy_admin_port}"
        _, _, value = fetch(f"{admin}/stats?filter=^{stat}$").strip().rpartition(" ")
        return int(value) if value.isdigit() else 0

    def retry_counts(self, cluster: str) -> dict[str, int]:
        """Envoy's counts of the cluster's retries (RETRY_COUNTERS), by short name."""
        admin = f"http://127.0.0.1:{self.local_mesh.settings.envoy_admin_port}"
        names = "|".join(RETRY_COUNTERS)
        counts = dict.fromkeys(RETRY_COUNTERS, 0)
        for line in fetch(f"{admin}/stats?filter=^cluster\\.{cluster}\\.({names})$").splitlines():
            stat, _, value = line.partition(": ")
            name = stat.rpartition(".")[2]
            if name in counts and value.strip().isdigit():
                counts[name] = int(value)
        return counts

    def worker_counts(self, timeout: float = BUSY_CALL_TIMEOUT_SECONDS) -> dict[str, WorkerCount]:
        """Each worker's own count of its Generate streams, by name; a worker that does not
        answer within `timeout` is left out."""
        workers = self.local_mesh.replicas("worker")
        pages = {worker.name: metrics_page(worker, timeout) for worker in workers}
        return {name: WorkerCount.of(page) for name, page in pages.items() if page}

    def kill_when_generating(
        self,
        within: float,
        kill: Callable[[dict[str, int]], None],
        before: dict[str, WorkerCount],
        to_clients: bool = False,
        in_flight: bool = False,
        busiest_only: bool = False,
    ) -> tuple[dict[str, int] | None, dict[str, Any]]:
        """Once every worker has streams open at Envoy and tokens are coming from the workers
        (Envoy has received more than a token's bytes per open stream since this began), call
        kill(streams open per worker) at once and return those streams; None if that did not
        come within `within` seconds. Also what was last seen, for a report. to_clients: and
        tokens are going out at the edge too (a few tokens' bytes per open stream): the clients'
        calls have their answers' headers, so a kill of Envoy cuts them instead of leaving
        them to the clients' transparent retries (a warm engine's first tokens reach the
        workers' hop before any has left the edge).

        Then every worker must also have sent token messages since `before` (worker_counts()
        before the scenario's streams began) by its own count, and with in_flight still have
        Generate streams it has not finished (see workers_generating): Envoy's bytes are the
        cluster's, and a worker whose engine has not started yet has streams open but none
        answered, which Envoy retries elsewhere when it dies, so its kill would test nothing
        (docs/failure-behaviour.md). busiest_only: only the worker with the most streams open
        must have them, and be generating (a scenario that kills that one, wherever the
        streams went). A busy worker that does not answer within
        WATCH_CALL_TIMEOUT_SECONDS is asked again on the next look.

        Blocking, for a thread of its own, so that neither the polling nor the kill waits for
        the scenario's event loop. Looks may still be many seconds apart: under the full
        scenarios' load the kernel left this whole process without a core for 14 s, as long
        as a burst of streams lives (seen["longest_gap_s"] reports it), which is why the
        scenarios hold some streams open until the kill (HELD_TOP_LOGPROBS)."""
        workers = [w.name for w in self.local_mesh.replicas("worker")]
        addresses = {w.name: w.address for w in self.local_mesh.replicas("worker")}
        seen: dict[str, Any] = {"looks": 0, "slowest_worker_metrics_s": 0.0}
        begun = time.monotonic()
        received_before = self.received_from("worker")
        sent_before = self.sent_to_clients() if to_clients else 0
        looked = begun
        while time.monotonic() - begun < within:
            # The longest time between two looks (how long this thread went without a core,
            # or Envoy's admin without an answer), for the report.
            now = time.monotonic()
            seen["longest_gap_s"] = round(max(seen.get("longest_gap_s", 0.0), now - looked), 2)
            looked = now
            open_now = self.open_streams("worker")
            streams = {name: open_now.get(addresses[name], 0) for name in workers}
            received = self.received_from("worker") - received_before
            sent = self.sent_to_clients() - sent_before if to_clients else None
            seen.update(
                envoy_open=streams,
                # The hosts Envoy listed (their addresses), to tell a host it did not list or
                # listed under another address from one with no streams open; and the cluster's
                # own count of active requests, to tell streams Envoy counts on no listed host
                # from streams it does not count at all.
                envoy_listed=sorted(open_now),
                cluster_rq_active=self._envoy_counter("cluster.worker.upstream_rq_active"),
                received_bytes=received,
                sent_bytes=sent or 0,
                looks=seen["looks"] + 1,
            )
            if envoy_sees_streams(streams, received, sent, every=not busiest_only):
                asked = time.monotonic()
                counts = self.worker_counts(WATCH_CALL_TIMEOUT_SECONDS)
                seen["slowest_worker_metrics_s"] = round(
                    max(seen["slowest_worker_metrics_s"], time.monotonic() - asked), 2
                )
                seen["worker_messages"] = {
                    name: count.messages - before[name].messages
                    for name, count in counts.items()
                    if name in before
                }
                seen["worker_unfinished"] = {n: c.unfinished for n, c in counts.items()}
                generating = [max(workers, key=streams.__getitem__)] if busiest_only else workers
                if workers_generating(generating, before, counts, in_flight):
                    kill(streams)
                    seen["after_s"] = round(time.monotonic() - begun, 2)
                    return streams, seen
            time.sleep(0.02)
        return None, seen

    async def engine_empty_since(self, worker: Program, within: float) -> int | None:
        """Since when (ns since the epoch) the worker's vLLM scheduler has reported nothing
        running or waiting; None if it did not report empty within `within` seconds."""
        async with aio.insecure_channel(worker.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            try:
                return await engine_empty_at(
                    stub, within=within, call_timeout=BUSY_CALL_TIMEOUT_SECONDS
                )
            except TimeoutError:
                return None


def fetch(url: str, timeout: float = BUSY_CALL_TIMEOUT_SECONDS) -> str:
    """The page at url, or "" when it does not answer."""
    return fetch_text(url, timeout, default="")


def metrics_page(program: Program, timeout: float = BUSY_CALL_TIMEOUT_SECONDS) -> str:
    """The program's /metrics page, or "" when it does not answer within `timeout`."""
    return fetch(f"http://127.0.0.1:{program.metrics_port}/metrics", timeout)


def killpg(pid: int, sig: signal.Signals) -> None:
    """sig to the program's whole process group, as when its container or host dies."""
    os.killpg(pid, sig)


def streams_move(local_mesh: LocalMesh) -> bool:
    """Whether this mesh moves a dead worker's streams to another worker: the edge's stream
    relay does, and so do the gateways on the gateway path; Envoy's router alone cannot."""
    settings = local_mesh.settings
    return settings.mesh().relays or not settings.direct_token_path


async def worker_kill(mesh: ScenarioMesh, short: bool) -> Row:
    """SIGKILL a worker's own process (as the OOM killer or a crash would) while streams run on
    it: its engine's processes end within 5 s; its streams move to the other worker and
    complete whole where the mesh moves streams (streams_move), and otherwise end promptly
    with an error (see below); the other worker's complete, requests sent meanwhile all
    succeed (Envoy retries them on the other worker before their first token), Envoy stops
    routing to the dead worker within seconds, and it rejoins once supervisord has restarted
    it, with one engine's memory, not two."""
    row = Row("worker_kill")
    workers = mesh.local_mesh.replicas("worker")
    pids = {worker.name: mesh.local_mesh.pid(worker.name) for worker in workers}
    # Both workers must be routable first: after an endpoint update (a control plane that
    # restarted) Envoy may health-check a host again before it routes to it.
    if not await workers_routable(mesh, row):
        return row
    # Long streams that keep both engines decoding, and streams held open until the kill.
    streams, held, burst = (24, 8, 16) if short else (48, 8, 48)
    before = await asyncio.to_thread(mesh.worker_counts)
    retries_before = await asyncio.to_thread(mesh.retry_counts, "worker")
    release = asyncio.Event()
    loop = asyncio.get_running_loop()
    async with mesh.channel() as channel, mesh.channel(held=True) as held_channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        running, events = start_streams(
            stub, llm_pb2_grpc.LLMServiceStub(held_channel), "kill", streams, held, release
        )
        # The kill comes while every worker has streams in flight, by Envoy's and the workers'
        # own counts (kill_when_generating): this client's first tokens are no guide, as its
        # loop may be seconds behind.
        killed: dict[str, Any] = {}

        def kill(streams: dict[str, int]) -> None:
            # The victim: the worker with the most streams open right now, by Envoy's count;
            # its process and children (vLLM's engine core and workers, multiprocessing's
            # tracker), and how long each child takes to end.
            victim = max(workers, key=lambda w: streams[w.name])
            engine = process_tree(pids[victim.name])
            killed.update(victim=victim, engine=engine, rss_before=tree_rss(engine))
            killed["done_before_kill"] = sum(task.done() for task in running)
            killed["at"] = time.monotonic()
            os.kill(pids[victim.name], signal.SIGKILL)
            loop.call_soon_threadsafe(release.set)
            killed["ended"] = end_times(engine[1:], 15)

        running_now, seen = await asyncio.to_thread(
            mesh.kill_when_generating, 180, kill, before, False, True
        )
        release.set()
        row.notes["generating_after_s"] = seen.get("after_s")
        row.notes["watch"] = seen
        row.notes["first_tokens_seen_at_kill"] = sum(event.is_set() for event in events)
        if running_now is None:
            # Whether Envoy had taken a worker out (a failed check, an outlier ejection).
            row.notes["envoy_worker_health"] = {
                address: host.get("health_status", {})
                for cluster, address, host in envoy_host_statuses(
                    mesh.local_mesh.settings.envoy_admin_port
                )
                if cluster == "worker"
            }
            row.violations.append(f"the workers were not both generating within 180 s: {seen}")
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            return row
        victim, engine, rss_before = killed["victim"], killed["engine"], killed["rss_before"]
        done_before_kill, killed_at, ended = (
            killed["done_before_kill"],
            killed["at"],
            killed["ended"],
        )
        engine_gone = None if None in ended.values() else max(ended.values(), default=0.0)
        # New requests right after the kill: some are routed to the dead worker before Envoy's
        # health checks notice, and must be retried on the other one before their first token.
        fresh = [
            asyncio.create_task(generate(stub, request(f"after kill {i}", 16), 30))
            for i in range(burst)
        ]
        left = await mesh.wait_until(lambda: victim.address not in mesh.healthy("worker"), 15)
        in_flight = await asyncio.gather(*running)
        after = await asyncio.gather(*fresh)
    row.add(in_flight)
    row.add(after)
    retries = await asyncio.to_thread(mesh.retry_counts, "worker")
    row.notes["envoy_worker_retries"] = {
        name: count - retries_before[name] for name, count in retries.items()
    }
    failed = [o for o in in_flight if o.code != OK]
    moved = [o for o in in_flight if o.resumed]
    # How long a failed stream went silent before its error: the client may still be reading
    # tokens the gateway holds for it when the kill comes, and those come first.
    ended_within = max((o.ended - max(o.last_token, killed_at) for o in failed), default=0.0)
    row.notes["child_processes"] = len(engine) - 1
    row.notes["children_gone_after_s"] = None if engine_gone is None else round(engine_gone, 2)
    row.notes["each_child_gone_after_s"] = ended
    row.notes["streams_per_worker_at_kill"] = running_now
    row.notes["killed"] = victim.name
    row.notes["in_flight_failed"] = len(failed)
    row.notes["done_before_kill"] = done_before_kill
    row.notes["failed_streams_ended_within_s"] = round(ended_within, 2)
    row.notes["left_envoy_healthy_set_s"] = None if left is None else round(left, 2)
    row.notes["in_flight_moved"] = len(moved)
    row.notes["gap"] = gap_figures(in_flight)
    if streams_move(mesh.local_mesh):
        # The edge's stream relay, or the gateways on the gateway path, move the killed
        # worker's streams to the other one at the token where they stopped.
        row.check(bool(moved), "some in-flight streams were on the killed worker and moved")
        row.check(
            not failed,
            f"every in-flight stream completes whole and contiguous: {row.failed} {row.examples}",
        )
    else:
        row.check(bool(failed), "some in-flight stream was on the killed worker")
        # On the direct token path without the relay, Envoy has sent the worker's headers to
        # the caller already and can only reset the stream (RST_STREAM, which gRPC clients
        # report as INTERNAL, "Stream removed"): HTTP/2 has no way to add a status to a
        # stream whose upstream is gone.
        row.check(
            all(o.code in ("UNAVAILABLE", "INTERNAL") and o.details for o in failed),
            f"in-flight streams on the killed worker end UNAVAILABLE or INTERNAL with a "
            f"message: {sorted({(o.code, o.details[:80]) for o in failed})}",
        )
        # Typically 0.6 s; the bound tells a prompt end from one at the 60 s stream idle
        # timeout with room for a busy box (5.4 s seen with a test suite running beside it).
        row.check(
            ended_within <= 10,
            f"they end within 10 s of the kill or of their last token, not at an idle timeout "
            f"({ended_within:.1f}s)",
        )
        row.check(
            all(o.tokens > 0 for o in failed),
            f"only streams that had begun fail (others are retried): Envoy's retries "
            f"{row.notes['envoy_worker_retries']}",
        )
    row.check(all(o.code == OK for o in after), "requests sent after the kill all succeed")
    row.check(left is not None and left <= 5, f"dead worker out of Envoy within 5 s ({left})")
    row.check(
        len(engine) > 1 and engine_gone is not None and engine_gone <= 5,
        f"the killed worker's {len(engine) - 1} child processes (engine core, its workers, "
        f"multiprocessing's tracker) end within 5 s ({engine_gone})",
    )
    rejoin_started = time.monotonic()
    row.check(await mesh.rejoined(victim), "the restarted worker rejoins Envoy's healthy set")
    row.recovered(time.monotonic() - killed_at)
    row.notes["rejoined_after_restart_s"] = round(time.monotonic() - rejoin_started, 1)
    # What the worker holds now: its restarted tree, plus anything of the old one still running
    # (an orphaned engine would double it).
    restarted = process_tree(mesh.local_mesh.pid(victim.name))
    rss_after = tree_rss(restarted) + tree_rss([p for p in engine if alive([p])])
    row.notes["worker_rss_mib_before_after"] = [rss_before >> 20, rss_after >> 20]
    # By memory and by the old tree's survivors, not by a count of processes: the tree at the
    # kill may hold passing children (seen: 6 processes at the kill, 4 once restarted and
    # serving, with the memory of one engine).
    row.check(
        not alive(engine) and rss_after < 1.5 * rss_before,
        f"memory back to one engine's worth: {len(engine)} processes, {rss_before >> 20} MiB "
        f"before the kill; {len(restarted)} processes, {rss_after >> 20} MiB after",
    )
    return row


def start_streams(
    stub: llm_pb2_grpc.LLMServiceStub,
    held_stub: llm_pb2_grpc.LLMServiceStub,
    label: str,
    streams: int,
    held: int,
    release: asyncio.Event,
) -> tuple[list[asyncio.Task[Outcome]], list[asyncio.Event]]:
    """`streams` streams of 2,000 tokens read as they come, then `held` ones (held_stub's
    channel: channel(held=True)) that read nothing past their first token until release is
    set; and for each an event set on its first token."""
    events = [asyncio.Event() for _ in range(streams + held)]
    running = [
        asyncio.create_task(generate(stub, request(f"{label} {i}", 2000), 120, events[i]))
        for i in range(streams)
    ]
    running += [
        asyncio.create_task(
            generate(
                held_stub, held_request(f"{label} held {i}"), 120, events[streams + i], hold=release
            )
        )
        for i in range(held)
    ]
    return running, events


def alive(processes: Sequence[psutil.Process]) -> bool:
    """Whether any of them still runs (a killed process waiting to be reaped does not)."""
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            continue
    return False


def end_times(processes: Sequence[psutil.Process], within: float) -> dict[str, float | None]:
    """Seconds until each process ended (None: still running after `within`), by pid and
    name. Blocking (see Mesh.kill_when_generating)."""
    begun = time.monotonic()
    names = {}
    for process in processes:
        try:
            names[process.pid] = f"{process.pid} {' '.join(process.cmdline())[:40].strip()}"
        except psutil.Error:
            names[process.pid] = str(process.pid)
    ended: dict[str, float | None] = {}
    left = list(processes)
    while left and time.monotonic() - begun < within:
        for process in [p for p in left if not alive([p])]:
            ended[names[process.pid]] = round(time.monotonic() - begun, 2)
            left.remove(process)
        time.sleep(0.02)
    ended.update({names[process.pid]: None for process in left})
    return ended


def tree_rss(processes: Sequence[psutil.Process]) -> int:
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


async def steady_load(
    stub: llm_pb2_grpc.LLMServiceStub, stop: asyncio.Event, clients: int, limit: float
) -> list[Outcome]:
    """`clients` loops, each sending one 32-token request after another until stop is set."""
    outcomes: list[Outcome] = []
    begun = time.monotonic()

    async def loop(client: int) -> None:
        for i in range(100_000):
            if stop.is_set() or time.monotonic() - begun > limit:
                return
            outcomes.append(await generate(stub, request(f"steady {client} {i}", 32), 30))

    await asyncio.gather(*(loop(client) for client in range(clients)))
    return outcomes


async def complete_openai(
    client: openai.AsyncOpenAI,
    model: str,
    prompt: str,
    max_tokens: int,
    deadline: float,
    started: asyncio.Event | None = None,
) -> Outcome:
    """One streamed /v1/completions through the edge with the official SDK: OK only with one
    finish, the usage chunk counting max_tokens and the stream's [DONE] (the SDK raises on a
    body cut short); HUNG past its deadline and HANG_MARGIN_SECONDS."""
    begun = time.monotonic()
    outcome = Outcome(OK)
    finishes, usage = 0, None

    async def read() -> None:
        nonlocal finishes, usage
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            timeout=deadline,
        )
        async for chunk in stream:
            moved = int((chunk.model_extra or {}).get("tokenmesh", {}).get("resumed", 0) or 0)
            if moved and not outcome.resumed:
                outcome.gap_seconds = time.monotonic() - outcome.last_token
            outcome.resumed = max(outcome.resumed, moved)
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if outcome.tokens == 0:
                    outcome.first_token_seconds = time.monotonic() - begun
                    if started is not None:
                        started.set()
                outcome.tokens += 1  # a chunk: tokens are counted by the usage chunk
                finishes += choice.finish_reason is not None
            outcome.last_token = time.monotonic()

    try:
        await asyncio.wait_for(read(), deadline + HANG_MARGIN_SECONDS)
    except TimeoutError:
        outcome.code = HUNG
    except openai.APIError as err:
        outcome.code = type(err).__name__
        outcome.details = str(err)
    else:
        generated = usage.completion_tokens if usage is not None else None
        outcome.tokens = generated or 0
        if generated != max_tokens or finishes != 1:
            outcome.code = "INCOMPLETE"
            outcome.details = f"{generated} of {max_tokens} tokens, {finishes} finishes"
    outcome.seconds = time.monotonic() - begun
    outcome.ended_unix_nanos = time.time_ns()
    outcome.ended = time.monotonic()
    return outcome


async def engine_kill(mesh: ScenarioMesh, short: bool) -> Row:
    """SIGKILL only a worker's engine core (a GPU fault: its front end lives) while 16 gRPC and
    16 OpenAI streams of 1,000 tokens run through the edge: the worker turns NOT_SERVING at
    once and hands its streams over to the other worker, where each goes on from the token it
    stopped at; every stream completes, contiguous and whole ([DONE] / OK), those that moved
    say so, and the worker rejoins once restarted with a new engine."""
    return await kill_an_engine(mesh, "engine_kill", lambda i: f"engine kill {i}", warm=False)


def gap_figures(outcomes: Sequence[Outcome]) -> dict[str, float | int | None]:
    """The gaps moved streams' callers saw: how many, p50, p99 and the longest, in ms."""
    gaps = sorted(o.gap_seconds for o in outcomes if o.gap_seconds is not None)
    if not gaps:
        return {"moved": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}

    def at(q: float) -> float:
        return round(1000 * gaps[min(len(gaps) - 1, int(q * len(gaps)))], 1)

    return {"moved": len(gaps), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": at(1.0)}


async def warm_prefix_caches(mesh: ScenarioMesh, prompts: Sequence[str]) -> None:
    """Every worker prefills every prompt once (one token each, asked directly), so whichever
    worker a stream moves to has its prompt in its prefix cache."""
    for worker in mesh.local_mesh.replicas("worker"):
        async with aio.insecure_channel(worker.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            for prompt in prompts:
                request_ = inference_pb2.InferenceRequest(
                    prompt=prompt, sampling=inference_pb2.SamplingParams(max_tokens=1)
                )
                async for _ in stub.Generate(request_, timeout=BUSY_CALL_TIMEOUT_SECONDS):
                    pass


async def workers_routable(mesh: ScenarioMesh, row: Row) -> bool:
    """Whether every worker is in Envoy's healthy set (within 60 s): after an endpoint update
    (a control plane that restarted) Envoy may health-check a host again before it routes to
    it. If not, the row says so."""
    addresses = {worker.address for worker in mesh.local_mesh.replicas("worker")}
    if await mesh.wait_until(lambda: addresses <= mesh.healthy("worker"), 60) is None:
        row.violations.append(
            f"the workers were not all healthy in Envoy: {mesh.healthy('worker')}"
        )
        return False
    return True


async def grpc_and_openai_through_a_kill(
    mesh: ScenarioMesh,
    row: Row,
    prompt: Callable[[int], str],
    streams: int,
    max_tokens: int,
    kill: Callable[[dict[str, int]], None],
    after_kill: Callable[[], Awaitable[Any]] | None = None,
) -> tuple[dict[str, int], list[Outcome], Any] | None:
    """`streams` gRPC Generate streams and `streams` OpenAI completions (the official SDK) of
    `max_tokens` through the edge, stream i's prompt prompt(i), gRPC first; kill(streams open
    per worker) once every worker generates (ScenarioMesh.kill_when_generating), then
    after_kill() while the streams go on. The streams open at the kill, every stream's
    outcome and after_kill's result, in that order; None, noted in the row, when the workers
    did not all generate within 180 s."""
    model = Path(mesh.local_mesh.settings.model).name
    before = await asyncio.to_thread(mesh.worker_counts)
    base_url = f"http://{mesh.edge}/v1"
    async with (
        mesh.channel() as channel,
        openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client,
    ):
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        running = [
            asyncio.create_task(generate(stub, request(prompt(i), max_tokens), 180))
            for i in range(streams)
        ]
        running += [
            asyncio.create_task(
                complete_openai(client, model, prompt(streams + i), max_tokens, 180)
            )
            for i in range(streams)
        ]
        running_now, seen = await asyncio.to_thread(
            mesh.kill_when_generating, 180, kill, before, True, True
        )
        row.notes["watch"] = seen
        if running_now is None:
            row.violations.append(f"the workers were not both generating within 180 s: {seen}")
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            return None
        seen_after = None if after_kill is None else await after_kill()
        return running_now, list(await asyncio.gather(*running)), seen_after


async def kill_an_engine(
    mesh: ScenarioMesh, name: str, prompt: Callable[[int], str], warm: bool, whole: bool = False
) -> Row:
    """engine_kill with these prompts (stream i's: prompt(i), gRPC ones first); warm: every
    worker has every prompt in its prefix cache first; whole: SIGKILL the worker itself (its
    engine dies with it), which only a mesh whose gateways relay the tokens survives. Its
    notes have the gaps the moved streams' callers saw (gap_figures)."""
    row = Row(name)
    workers = mesh.local_mesh.replicas("worker")
    if not await workers_routable(mesh, row):
        return row
    # Streams of each protocol (gRPC, then OpenAI), and their length.
    streams, max_tokens = 16, 1000
    if warm:
        await warm_prefix_caches(mesh, [prompt(i) for i in range(2 * streams)])
    pids = {worker.name: mesh.local_mesh.pid(worker.name) for worker in workers}
    cores = {worker: engine_cores(pid) for worker, pid in pids.items()}
    killed: dict[str, Any] = {}

    def kill(open_streams: dict[str, int]) -> None:
        victim = max(workers, key=lambda w: open_streams[w.name])
        killed.update(victim=victim, at=time.monotonic())
        for process in [pids[victim.name]] if whole else [c.pid for c in cores[victim.name]]:
            os.kill(process, signal.SIGKILL)

    async def victim_left() -> float | None:
        victim = killed["victim"]
        return await mesh.wait_until(lambda: victim.address not in mesh.healthy("worker"), 15)

    killing = await grpc_and_openai_through_a_kill(
        mesh, row, prompt, streams, max_tokens, kill, victim_left
    )
    if killing is None:
        return row
    running_now, outcomes, left = killing
    victim = killed["victim"]
    row.add(outcomes)
    moved = [o for o in outcomes if o.resumed]
    row.notes["killed"] = f"{victim.name} (whole)" if whole else victim.name
    row.notes["engine_cores_killed"] = len(cores[victim.name])
    row.notes["streams_per_worker_at_kill"] = running_now
    row.notes["moved_grpc_openai"] = [
        sum(1 for o in outcomes[:streams] if o.resumed),
        sum(1 for o in outcomes[streams:] if o.resumed),
    ]
    row.notes["left_envoy_healthy_set_s"] = None if left is None else round(left, 2)
    row.notes["gap"] = gap_figures(outcomes)
    row.notes["prefix_caches"] = "warm" if warm else "cold"
    row.check(bool(cores[victim.name]), "the worker has an engine core process to kill")
    row.check(
        all(o.code == OK for o in outcomes),
        f"every stream completes whole and contiguous: {row.failed} {row.examples}",
    )
    row.check(bool(moved), "some streams were on the killed engine and moved")
    row.check(left is not None and left <= 5, f"the worker out of rotation within 5 s ({left})")
    rejoin_started = time.monotonic()
    row.check(await mesh.rejoined(victim), "the worker rejoins with a new engine")
    row.recovered(time.monotonic() - killed["at"])
    row.notes["rejoined_after_s"] = round(time.monotonic() - rejoin_started, 1)
    return row


async def engines_all_dead(mesh: ScenarioMesh, short: bool) -> Row:
    """SIGKILL every worker's engine core while 8 gRPC and 8 OpenAI streams of 1,000 tokens run
    through the edge: with no worker left to move to, every stream ends promptly with a clear
    error (gRPC UNAVAILABLE with a message; OpenAI's an error event in the begun stream, which
    the SDK raises, or a 503 if it had not begun), none hangs; both workers rejoin once
    restarted."""
    row = Row("engines_all_dead")
    workers = mesh.local_mesh.replicas("worker")
    if not await workers_routable(mesh, row):
        return row
    cores = [core for w in workers for core in engine_cores(mesh.local_mesh.pid(w.name))]
    streams, max_tokens = 8, 1000
    killed: dict[str, float] = {}

    def kill(_: dict[str, int]) -> None:
        killed["at"] = time.monotonic()
        for core in cores:
            os.kill(core.pid, signal.SIGKILL)

    killing = await grpc_and_openai_through_a_kill(
        mesh, row, lambda i: f"all dead {i}", streams, max_tokens, kill
    )
    if killing is None:
        return row
    running_now, outcomes, _ = killing
    row.add(outcomes)
    cut = [o for o in outcomes if o.code != OK]
    ended_within = max((o.ended - killed["at"] for o in cut), default=0.0)
    row.notes["engine_cores_killed"] = len(cores)
    row.notes["streams_per_worker_at_kill"] = running_now
    row.notes["cut_streams_ended_within_s"] = round(ended_within, 2)
    row.check(bool(cut), "some streams were running when the engines died")
    grpc_cut, openai_cut = cut_by_protocol(outcomes, streams)
    row.check(
        all(o.code == "UNAVAILABLE" and o.details for o in grpc_cut),
        f"gRPC streams end UNAVAILABLE with a message: {ends_seen(grpc_cut)}",
    )
    # OpenAI's: an error event in a begun stream (the SDK's APIError), or, for a stream whose
    # headers had not gone out yet, Envoy's 503 (no healthy upstream; the SDK's
    # InternalServerError).
    row.check(
        all(
            o.code == "APIError" or (o.code == "InternalServerError" and "503" in o.details)
            for o in openai_cut
        ),
        f"OpenAI streams end with an error event or a 503: {ends_seen(openai_cut)}",
    )
    row.check(ended_within <= 30, f"they end within 30 s of the kill ({ended_within:.1f} s)")
    for worker in workers:
        row.check(await mesh.rejoined(worker), f"{worker.name} rejoins with a new engine")
    row.recovered(time.monotonic() - killed["at"])
    return row


def ends_seen(outcomes: Sequence[Outcome]) -> list[tuple[str, str]]:
    return sorted({(o.code, o.details[:80]) for o in outcomes})


def cut_by_protocol(
    outcomes: Sequence[Outcome], streams: int
) -> tuple[list[Outcome], list[Outcome]]:
    """The failed gRPC streams (the first `streams`) and the failed OpenAI ones."""
    return (
        [o for o in outcomes[:streams] if o.code != OK],
        [o for o in outcomes[streams:] if o.code != OK],
    )


async def rolling_restart(mesh: ScenarioMesh, short: bool) -> Row:
    """SIGTERM each worker in turn under steady load, the next once the previous one is back
    in Envoy: no request fails."""
    row = Row("rolling_restart")
    workers = mesh.local_mesh.replicas("worker")
    workers = workers[:1] if short else workers
    # A rollout starts from a healthy set (a worker restarted just before, by another
    # scenario or a stalled machine, may still be loading its model).
    addresses = {worker.address for worker in mesh.local_mesh.replicas("worker")}
    healthy = await mesh.wait_until(
        lambda: addresses <= mesh.healthy("worker"), REJOIN_WITHIN_SECONDS, 1
    )
    if healthy is None:
        row.violations.append(f"the workers were not all healthy: {mesh.healthy('worker')}")
        return row
    stop = asyncio.Event()
    async with mesh.channel() as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        load = asyncio.create_task(steady_load(stub, stop, 4, limit=len(workers) * 400))
        await asyncio.sleep(1)
        for worker in workers:
            begun = time.monotonic()
            os.kill(mesh.local_mesh.pid(worker.name), signal.SIGTERM)
            left = await mesh.wait_until(
                lambda w=worker: w.address not in mesh.healthy("worker"), 10
            )
            row.notes[f"{worker.name}_left_healthy_set_s"] = (
                None if left is None else round(left, 2)
            )
            row.check(left is not None and left <= 2.5, f"{worker.name} NOT_SERVING within 2.5 s")
            back = await mesh.rejoined(worker)
            row.check(back, f"{worker.name} rejoins after its restart")
            row.recovered(time.monotonic() - begun)
            if not back:
                break  # as a rollout would: never restart the next before this one is back
        await asyncio.sleep(1)
        stop.set()
        outcomes = await load
    row.add(outcomes)
    row.check(all(o.code == OK for o in outcomes), "zero failed requests across the restart")
    return row


async def reranker_hang(mesh: ScenarioMesh, short: bool) -> Row:
    """SIGSTOP the reranker (calls time out rather than fail fast): answers stream degraded with
    the warning, and once every gateway's breaker is open, at normal latency; SIGCONT: answers
    are reranked again after the breaker's half-open probe."""
    row = Row("reranker_hang")
    reranker = mesh.local_mesh.program("reranker")
    gateways = mesh.local_mesh.replicas("gateway")
    pid = mesh.local_mesh.pid("reranker")
    half_open_before = sum(
        mesh.metric(g, "tokenmesh_reranker_circuit_transitions_total", to="half_open")
        for g in gateways
    )
    async with mesh.channel() as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)

        async def batch(label: str, n: int) -> list[Outcome]:
            return list(
                await asyncio.gather(
                    *(generate(stub, request(f"{label} {i}", 8, DOCUMENTS), 20) for i in range(n))
                )
            )

        baseline = await batch("before", 4)
        row.add(baseline)
        row.check(not any(o.degraded for o in baseline), "answers are reranked before the fault")
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            opened = False
            hung_phase: list[Outcome] = []
            for round_ in range(30):
                hung_phase += await batch(f"hung {round_}", 4)
                if all(mesh.metric(g, "tokenmesh_reranker_circuit_state") == 2 for g in gateways):
                    opened = True
                    break
            row.add(hung_phase)
            row.notes["breakers_open_after_s"] = round(time.monotonic() - stopped_at, 2)
            row.check(opened, "every gateway's breaker opens")
            row.check(
                all(o.code == OK and o.degraded for o in hung_phase),
                "answers stream degraded (with the warning) while the reranker hangs",
            )
            open_phase = await batch("open", 8 if short else 32)
            row.add(open_phase)
            ttfts = sorted((o.first_token_seconds or 99) for o in open_phase)
            row.notes["max_ttft_open_s"] = round(ttfts[-1], 3)
            median = ttfts[len(ttfts) // 2]
            row.notes["median_ttft_open_s"] = round(median, 3)
            row.check(all(o.code == OK and o.degraded for o in open_phase), "degraded while open")
            # Nobody waits for the hung reranker once open: typical TTFT is well under the 1 s
            # rerank timeout every call paid before (no tighter bound: a busy machine is slow).
            row.check(median < 1.0, f"latency back to normal once open (median TTFT {median:.2f}s)")
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        recovered = None
        for i in range(60):
            (outcome,) = await batch(f"resumed {i}", 1)
            row.add([outcome])
            if outcome.code == OK and not outcome.degraded:
                recovered = time.monotonic() - resumed_at
                break
            await asyncio.sleep(0.5)
        # Each gateway closes its own breaker; the one not asked above does at its next call.
        for _ in range(20):
            rest = await batch("closed", 4)
            row.add(rest)
            if all(mesh.metric(g, "tokenmesh_reranker_circuit_state") == 0 for g in gateways):
                break
            await asyncio.sleep(0.5)
    half_open = sum(
        mesh.metric(g, "tokenmesh_reranker_circuit_transitions_total", to="half_open")
        for g in gateways
    )
    row.check(recovered is not None, "answers are reranked again after SIGCONT")
    row.check(half_open > half_open_before, "recovery goes through half-open")
    row.check(reranker.address in mesh.healthy("reranker"), "the reranker is healthy in Envoy")
    row.recovered(recovered if recovered is not None else 30)
    row.notes["reranked_again_after_s"] = None if recovered is None else round(recovered, 2)
    return row


async def deadline_storm(mesh: ScenarioMesh, short: bool) -> Row:
    """Requests whose deadlines are shorter than their generation: all end DEADLINE_EXCEEDED
    and every engine is empty at most 1 s after the last one ended. Requests from another
    client beside the storm complete: the storm's resets (every stream cancelled within a
    second or so of its start, on connections shared with other callers past the edge) cut
    nobody else's streams."""
    row = Row("deadline_storm")
    count, bystanders = (100, 2) if short else (500, 4)
    rng = random.Random(7)
    workers = mesh.local_mesh.replicas("worker")
    aborted_before = sum(mesh.metric(w, "tokenmesh_worker_aborted_requests_total") for w in workers)
    # As docs/failure-behaviour.md tells clients: hundreds of short-deadline requests spread over
    # connections of STORM_STREAMS_PER_CONNECTION, and the bystanders another client's.
    connections = -(-count // STORM_STREAMS_PER_CONNECTION)
    async with contextlib.AsyncExitStack() as stack:
        stubs = [
            llm_pb2_grpc.LLMServiceStub(
                await stack.enter_async_context(mesh.channel(own_connection=True))
            )
            for _ in range(connections)
        ]
        other = llm_pb2_grpc.LLMServiceStub(
            await stack.enter_async_context(mesh.channel(own_connection=True))
        )
        begun_ns = time.time_ns()
        storm = [
            asyncio.create_task(
                generate(stubs[i % connections], request(f"storm {i}", 2000), rng.uniform(0.3, 1.5))
            )
            for i in range(count)
        ]
        await asyncio.sleep(0.2)
        beside = [
            asyncio.create_task(generate(other, request(f"beside the storm {i}", 64), 120))
            for i in range(bystanders)
        ]
        outcomes = await asyncio.gather(*storm)
        beside_outcomes = await asyncio.gather(*beside)
    row.add(outcomes)
    row.add(beside_outcomes)
    row.notes["streams_with_tokens"] = sum(o.tokens > 0 for o in outcomes)
    row.notes["tokens_received"] = sum(o.tokens for o in outcomes)
    row.notes["storm_s"] = round((max(o.ended_unix_nanos for o in outcomes) - begun_ns) / 1e9, 2)
    last_ns = max(o.ended_unix_nanos for o in [*outcomes, *beside_outcomes])
    row.check(
        all(o.code == "DEADLINE_EXCEEDED" for o in outcomes), "every request DEADLINE_EXCEEDED"
    )
    row.check(
        all(o.code == OK for o in beside_outcomes),
        f"requests beside the storm complete: {[o.code for o in beside_outcomes]}",
    )
    lags = []
    for worker in mesh.local_mesh.replicas("worker"):
        empty_since = await mesh.engine_empty_since(worker, within=10)
        # Negative: the worker had aborted everything before the last client saw its deadline
        # (each hop's deadline is the caller's minus a margin).
        lag = None if empty_since is None else (empty_since - last_ns) / 1e9
        lags.append(lag)
        row.notes[f"{worker.name}_empty_after_last_s"] = None if lag is None else round(lag, 3)
    worst = max((lag if lag is not None else 99.0) for lag in lags)
    row.check(worst <= 1.0, f"engines empty within 1 s of the last request ({worst:.3f}s)")
    # Engine requests the workers aborted as callers' deadlines passed: the storm reached
    # vLLM (and was taken back out), it did not just expire in queues in front of it.
    aborted = sum(mesh.metric(w, "tokenmesh_worker_aborted_requests_total") for w in workers)
    row.notes["engine_requests_aborted"] = int(aborted - aborted_before)
    row.check(aborted > aborted_before, "the storm's requests reached the engines")
    row.recovered(max(worst, 0.0))
    return row


async def controlplane_down(mesh: ScenarioMesh, short: bool) -> Row:
    """Stop the control plane: Envoy keeps routing to its last known endpoints. A discovery
    change made meanwhile applies once it is back."""
    row = Row("controlplane_down")
    workers = mesh.local_mesh.replicas("worker")
    removed = workers[-1]
    local_mesh = mesh.local_mesh
    n = 8 if short else 32
    async with mesh.channel() as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)

        async def batch(label: str) -> list[Outcome]:
            return list(
                await asyncio.gather(
                    *(generate(stub, request(f"{label} {i}", 16), 30) for i in range(n))
                )
            )

        local_mesh.ctl("stop", "controlplane")
        try:
            await asyncio.sleep(1)
            down = await batch("no discovery")
            await asyncio.sleep(2 if short else 10)
            down += await batch("no discovery later")
            row.add(down)
            row.check(all(o.code == OK for o in down), "requests succeed without discovery")
            row.check(
                mesh.healthy("worker") == {w.address for w in workers},
                "Envoy keeps every last known worker",
            )
            endpoints = local_mesh.endpoints()
            endpoints["clusters"]["worker"].remove(removed.address)
            local_mesh.endpoints_path.write_text(yaml.safe_dump(endpoints))
            await asyncio.sleep(0.5)
            row.check(removed.address in mesh.known("worker"), "no change while discovery is down")
        finally:
            restarted_at = time.monotonic()
            local_mesh.ctl("start", "controlplane")
        applied = await mesh.wait_until(lambda: removed.address not in mesh.known("worker"), 30)
        row.notes["change_applied_after_restart_s"] = None if applied is None else round(applied, 2)
        row.check(applied is not None, "a discovery change applies once the control plane is back")
        row.recovered(applied if applied is not None else time.monotonic() - restarted_at)
        local_mesh.endpoints_path.write_text(
            yaml.safe_dump(local_mesh.endpoints(), sort_keys=False)
        )
        back = await mesh.wait_until(lambda: removed.address in mesh.healthy("worker"), 30)
        row.check(back is not None, "the worker added back is routed to again")
        after = await batch("discovery back")
        row.add(after)
        row.check(all(o.code == OK for o in after), "requests succeed after discovery returns")
    return row


async def envoy_restart(mesh: ScenarioMesh, short: bool) -> Row:
    """SIGKILL Envoy under load (supervisord restarts it): in-flight streams fail with a clear
    status; clients with docs/failure-behaviour.md's retry and wait-for-ready settings get
    answers as soon as it is back."""
    row = Row("envoy_restart")
    pid = mesh.local_mesh.pid("envoy")
    # Long streams, and streams held open until the kill (as in worker_kill).
    streams, held, fresh_count = (16, 8, 8) if short else (32, 8, 32)
    before = await asyncio.to_thread(mesh.worker_counts)
    release = asyncio.Event()
    loop = asyncio.get_running_loop()
    async with (
        mesh.channel(retries=True) as channel,
        mesh.channel(retries=True, held=True) as held_channel,
    ):
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        running, events = start_streams(
            stub, llm_pb2_grpc.LLMServiceStub(held_channel), "envoy", streams, held, release
        )
        # The kill comes once every worker has answered, by the servers' own count (as in
        # worker_kill): every stream Envoy holds open then is in flight, the held ones at least.
        killed: list[float] = []
        answered: list[int] = []

        def kill(_: dict[str, int]) -> None:
            killed.append(time.monotonic())
            killpg(pid, signal.SIGKILL)
            answered.extend(i for i, event in enumerate(events) if event.is_set())
            loop.call_soon_threadsafe(release.set)

        generating, seen = await asyncio.to_thread(
            mesh.kill_when_generating, 180, kill, before, True
        )
        release.set()
        killed_at = killed[0] if killed else time.monotonic()
        row.notes["first_tokens_seen_at_kill"] = len(answered)
        row.notes["watch"] = seen
        row.check(generating is not None, f"the workers were generating within 180 s: {seen}")
        if generating is None:
            killpg(pid, signal.SIGKILL)
        await asyncio.sleep(0.2)
        fresh = [
            asyncio.create_task(generate(stub, request(f"while down {i}", 16), 60))
            for i in range(fresh_count)
        ]
        in_flight = await asyncio.gather(*running)
        after = await asyncio.gather(*fresh)
    row.add(in_flight)
    row.add(after)
    failed = [o for o in in_flight if o.code != OK]
    row.notes["in_flight_failed"] = len(failed)
    # A call whose answer's headers its client had not yet read when the connection reset is
    # retried by the client (a stream Envoy takes straight from a worker has its headers only
    # with its first token); one that had a token never is: no token comes twice. A stream the
    # client had read a token of may still end OK: Envoy may have sent all of it before it died
    # while the client was slow to read it; the held ones it had read a token of, larger than
    # the windows, were open. A held one not yet answered then (the kill may come a fraction of
    # a second after the streams began) is retried like any other.
    row.check(
        bool(failed) or not answered,
        "some stream was in flight when Envoy died (or none had been answered: all retried)",
    )
    held_answered = [in_flight[i] for i in answered if i >= streams]
    row.notes["held_answered_at_kill"] = len(held_answered)
    row.check(
        all(o.code != OK for o in held_answered),
        "every held stream answered before the kill (open at Envoy when it died) failed",
    )
    row.check(
        all(o.code == "UNAVAILABLE" and o.details for o in failed),
        "in-flight streams fail UNAVAILABLE with a message",
    )
    row.check(all(o.code == OK for o in after), "requests sent while Envoy restarts succeed")
    answered = max((o.ended - killed_at for o in after), default=0.0)
    row.notes["requests_sent_while_down_done_s"] = round(answered, 2)
    ready = await mesh.wait_until(mesh.local_mesh.envoy_ready, 60, every=0.5)
    row.check(ready is not None, "Envoy is back with every host healthy")
    row.recovered(answered)
    return row


# The deadline storm's streams per client connection. Envoy's HTTP/2 rapid-reset protection
# closes a connection once half of 500 streams on it were reset soon after they started, before
# any answer (overload.premature_reset_*, docs/failure-behaviour.md): a storm's own client,
# acting on its deadlines before the workers' DEADLINE_EXCEEDED came, did so with 500 on one.
STORM_STREAMS_PER_CONNECTION = 100


# Deadline of each overload stream: a refusal must come long before it.
OVERLOAD_DEADLINE = 60.0
# Tokens of each overload stream: enough to keep the batch full while the rest arrive, few enough
# that the queue (two batches' worth) drains within the small mesh's 5 s stream idle timeout, as
# a queued stream sends nothing until it runs.
OVERLOAD_TOKENS = 64


# The small mesh for overload (and the short stalled-client run): 1 gateway, 1 worker whose batch
# and queue overflow with a few dozen streams, and a short stream idle timeout.
SMALL_MESH_ENV = {
    "TOKENMESH_LOCALMESH_WORKER_MAX_NUM_SEQS": "4",
    "TOKENMESH_WORKER_MAX_WAITING_REQUESTS": "8",
    "TOKENMESH_MESH_STREAM_IDLE_TIMEOUT_SECONDS": "5",
}
MIB = 1024 * 1024


def worker_limits() -> tuple[int, int]:
    """max_num_seqs and max_waiting_requests the mesh's workers got from this environment."""
    from tokenmesh.localmesh.settings import LocalMeshSettings
    from tokenmesh.worker.config import WorkerSettings

    return LocalMeshSettings().worker_max_num_seqs, WorkerSettings().max_waiting_requests


async def overload(mesh: ScenarioMesh, short: bool) -> Row:
    """Twice as many concurrent streams as the workers admit (batch + queue): the excess is
    refused at once with RESOURCE_EXHAUSTED (no timeouts), and the admitted ones complete."""
    row = Row("overload")
    running, waiting = worker_limits()
    capacity = len(mesh.local_mesh.replicas("worker")) * (running + waiting)
    row.notes["capacity"] = capacity
    if capacity > 64:
        row.violations.append(
            f"overload needs small worker limits ({capacity} streams admitted); run it on the "
            f"small mesh ({SMALL_MESH_ENV})"
        )
        return row
    async with mesh.channel() as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        (alone,) = [await generate(stub, request("alone", 64), 30)]
        rounds = 1 if short else 3
        outcomes: list[Outcome] = []
        for round_ in range(rounds):
            outcomes += await asyncio.gather(
                *(
                    generate(
                        stub, request(f"overload {round_} {i}", OVERLOAD_TOKENS), OVERLOAD_DEADLINE
                    )
                    for i in range(2 * capacity)
                )
            )
    row.add([alone, *outcomes])
    refused = [o for o in outcomes if o.code == "RESOURCE_EXHAUSTED"]
    admitted = [o for o in outcomes if o.code == OK]
    row.notes["admitted"] = len(admitted)
    row.notes["max_refusal_s"] = round(max((o.seconds for o in refused), default=0.0), 3)
    row.notes["ttft_alone_s"] = round(alone.first_token_seconds or 0.0, 3)
    row.notes["max_ttft_admitted_s"] = round(
        max((o.first_token_seconds or 0.0 for o in admitted), default=0.0), 3
    )
    row.check(alone.code == OK, "a request alone succeeds")
    row.check(
        {o.code for o in outcomes} <= {OK, "RESOURCE_EXHAUSTED"},
        "every stream is admitted and completes, or is refused RESOURCE_EXHAUSTED",
    )
    row.check(bool(refused), "streams past the bound are refused")
    row.check(len(admitted) >= capacity * rounds, "at least the bound's worth are admitted")
    row.check(
        all("max_waiting_requests" in o.details for o in refused), "the refusal names the limit"
    )
    refusal_times = sorted(o.seconds for o in refused)
    median = refusal_times[len(refusal_times) // 2] if refusal_times else 0.0
    row.notes["median_refusal_s"] = round(median, 3)
    # Refused, not queued until the deadline: every refusal comes back within a small part of
    # it (typically ~0.1-0.5 s with Envoy's retries' backoff; a busy 2-core machine may take
    # seconds, so no tighter wall-clock bound here: the figures are in the row's notes).
    row.check(
        row.notes["max_refusal_s"] < OVERLOAD_DEADLINE / 6, "refusals come long before the deadline"
    )
    return row


async def stalled_client(mesh: ScenarioMesh, short: bool) -> Row:
    """A client opens streams and never reads them: flow control stops the mesh sending, memory
    in the gateway and Envoy stays bounded, another client is not held up, and Envoy's stream
    idle timeout cuts the stalled streams, which frees the engine."""
    from tokenmesh.meshconfig.config import MeshSettings

    row = Row("stalled_client")
    # Short: fewer than the small mesh's batch (4), so the bystander gets a place in it at once
    # rather than queueing behind stalled streams' generations.
    streams = min(8, worker_limits()[0] - 1) if short else 100
    # Alternatives per token make each stream larger than the windows (~650 KB at 20, ~170 KB
    # at 5, against 64 KiB). 100 streams at 20 saturate the workers' CPU on two cores (their
    # stats calls took over 5 s and a bystander waited 30 s for a token; at 5 or none it got
    # one within 0.2-4 s): that measures capacity, not flow control, so the full version asks
    # for 5.
    top_logprobs = 20 if short else 5
    idle_timeout = MeshSettings().stream_idle_timeout_seconds
    row.notes["stream_idle_timeout_s"] = idle_timeout
    workers = mesh.local_mesh.replicas("worker")
    names = [gateway.name for gateway in mesh.local_mesh.replicas("gateway")] + ["envoy"]
    processes = {name: psutil.Process(mesh.local_mesh.pid(name)) for name in names}
    # Long enough for the engine to finish the streams and the idle timeout to pass after that.
    deadline = idle_timeout + 180
    before = {name: p.memory_info().rss for name, p in processes.items()}
    peak = dict(before)
    aborted_before = sum(mesh.metric(w, "tokenmesh_worker_aborted_requests_total") for w in workers)
    async with aio.insecure_channel(mesh.edge, options=STALLED_CLIENT_OPTIONS) as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        calls = [
            stub.Generate(
                llm_pb2.GenerateRequest(
                    prompt=f"stalled {i}",
                    max_tokens=1900,
                    ignore_eos=True,
                    logprobs=True,
                    top_logprobs=top_logprobs,
                ),
                timeout=deadline,
            )
            for i in range(streams)
        ]
        opened_at = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(c.initial_metadata() for c in calls)), 60)
        async with mesh.channel() as other:
            bystander = await generate(llm_pb2_grpc.LLMServiceStub(other), request("by", 64), 30)
        row.add([bystander])
        row.check(bystander.code == OK, "another client streams while these stall")
        # Until every stalled stream has ended (cut by the idle timeout) or the bound passes.
        cut_within = None
        for _ in range(int((deadline + 5) / 0.25)):
            for name, process in processes.items():
                peak[name] = max(peak[name], process.memory_info().rss)
            if all(call.done() for call in calls):
                cut_within = time.monotonic() - opened_at
                break
            await asyncio.sleep(0.25)
        outcomes = []
        for call in calls:
            if not call.done():
                call.cancel()
                outcomes.append(Outcome(HUNG))
                continue
            code = await call.code()
            outcomes.append(Outcome(code.name, details=await call.details() or ""))
    row.add(outcomes)
    growth = {name: round((peak[name] - before[name]) / MIB, 1) for name in processes}
    row.notes["rss_growth_mib"] = growth
    row.notes["all_cut_after_s"] = None if cut_within is None else round(cut_within, 1)
    row.check(
        cut_within is not None and cut_within < deadline - 1,
        "the stream idle timeout cuts every stalled stream (before its deadline)",
    )
    row.check(all(o.code != OK for o in outcomes), "no stalled stream counts as delivered")
    # Windows of ~1 MiB per stream and hop at most, whatever the streams' size (~650 KB each).
    row.check(
        max(growth.values()) <= streams * 2 + 64,
        f"memory bounded by the windows: RSS growth {growth} MiB for {streams} streams",
    )
    for worker in workers:
        empty = await mesh.engine_empty_since(worker, within=10)
        row.check(empty is not None, f"{worker.name}'s engine is empty once the streams are cut")
    aborted = (
        sum(mesh.metric(w, "tokenmesh_worker_aborted_requests_total") for w in workers)
        - aborted_before
    )
    row.notes["engine_requests_aborted"] = aborted
    row.recovered(cut_within or 0.0)
    return row


Scenario = Callable[[ScenarioMesh, bool], Awaitable[Row]]
SCENARIOS: dict[str, Scenario] = {
    "worker_kill": worker_kill,
    "engine_kill": engine_kill,
    "rolling_restart": rolling_restart,
    "reranker_hang": reranker_hang,
    "deadline_storm": deadline_storm,
    "controlplane_down": controlplane_down,
    "envoy_restart": envoy_restart,
}
# Scenarios that need the small mesh's limits (SMALL_MESH_ENV); stalled_client runs there in its
# short version (a 5 s stream idle timeout), on the main mesh in full (100 streams, 60 s).
SMALL_SCENARIOS: dict[str, Scenario] = {"overload": overload, "stalled_client": stalled_client}
# Scenarios only `make chaos` runs (both workers restart: a minute or more on two cores).
FULL_ONLY_SCENARIOS: dict[str, Scenario] = {"engines_all_dead": engines_all_dead}
ALL_SCENARIOS = {**SCENARIOS, **FULL_ONLY_SCENARIOS, **SMALL_SCENARIOS}
