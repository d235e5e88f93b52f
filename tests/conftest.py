"""Shared fixtures: the real worker (real vLLM on the tiny model) starts once per session."""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from grpc import aio

from tests.consul_fake import FakeConsul
from tests.otlp_collector import OtlpCollector
from tests.stalls import StallWatch, describe, earns_rerun
from tests.support import (
    MESH_KEY,
    STOPS,
    TINY_MODEL,
    ServiceProcess,
    ready_mesh,
    reranker_process,
    started_mesh,
    stop_after_last_user,
    worker_process,
)
from tokenmesh.localmesh.mesh import LocalMesh, LocalMeshSettings
from tokenmesh.v1 import inference_pb2_grpc

LOG_DIR = Path(__file__).resolve().parent.parent / ".run" / "test-logs"
# vLLM engine arguments of the session's worker (TOKENMESH_WORKER_ENGINE_ARGS): a global seed
# other than vLLM's default, which changes nothing a test asserts.
WORKER_ENGINE_ARGS = {"seed": 1205}
# Loading vLLM takes ~40 s on 2 cores; a loaded CI machine may take several times that.
WORKER_START_TIMEOUT = 300.0
# Importing torch and loading MiniLM takes ~5 s on 2 cores; a loaded machine may take far longer.
RERANKER_START_TIMEOUT = 120.0


# The adapters' mesh and vLLM's own server with the adapter: session fixtures, started early.
pytest_plugins = ["tests.harness.adapter_meshes"]

STALL_WATCH = pytest.StashKey[StallWatch]()
# The session's heavy processes (fixtures that start them and return at once), started before
# the first test when any test of the run uses them: they load while the unit tests run.
EARLY_STARTS = (
    "adapters_mesh_started",
    "mesh_started",
    "worker_started",
    "reranker_started",
)
EARLY = pytest.StashKey[list[str]]()
TEST_BEGUN = pytest.StashKey[float]()
ATTEMPT_FAILED = pytest.StashKey[bool]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Unit tests run first, while the session's heavy processes the integration tests use
    start (early_starts); tests that stop the shared worker run after all others, in their
    file order, and those that end the shared mesh's workers right after its other tests (the
    mesh then stops); an integration test that fails while the machine itself stalled (stolen
    CPU time, a kernel lockup) runs once more (pytest-rerunfailures, reported as a rerun)."""
    items.sort(
        key=lambda item: (
            item.get_closest_marker("integration") is not None,
            item.get_closest_marker("stops_worker") is not None,
        )
    )
    config.stash[EARLY] = [
        name for name in EARLY_STARTS if any(name in item.fixturenames for item in items)
    ]
    ending = [item for item in items if item.get_closest_marker("ends_mesh") is not None]
    rest = [item for item in items if item.get_closest_marker("ends_mesh") is None]
    users = [i for i, item in enumerate(rest) if "mesh_started" in item.fixturenames]
    after = users[-1] + 1 if users else len(rest)
    items[:] = rest[:after] + ending + rest[after:]
    for item in items:
        if item.get_closest_marker("integration") is not None:
            item.add_marker(pytest.mark.flaky(reruns=1, condition=functools.partial(stalled, item)))


def stalled(item: pytest.Item) -> bool:
    """The machine itself stalled long enough for a rerun (tests/stalls.py, earns_rerun) since
    the test began (then the run's output says so: a rerun's first failure is not shown)."""
    stalls = item.config.stash[STALL_WATCH].since(item.stash.get(TEST_BEGUN, 0.0))
    if not earns_rerun(stalls):
        return False
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and item.stash.get(ATTEMPT_FAILED, False):
        reporter.write_line(f"\n{item.nodeid} failed; runs once more: {describe(stalls)}")
    return True


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stops_worker: ends the session's shared worker process")
    config.addinivalue_line("markers", "ends_mesh: ends the shared mesh's workers")
    watch = StallWatch()
    watch.start()
    config.stash[STALL_WATCH] = watch


def pytest_unconfigure(config: pytest.Config) -> None:
    watch = config.stash.get(STALL_WATCH, None)
    if watch is not None:
        watch.stop()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop each heavy session resource right after the last test that uses it
    (stop_after_last_user)."""
    stops = item.config.stash.get(STOPS, {})
    used = [name for name in stops if name in item.fixturenames]
    if not used:
        return
    later = item.session.items[item.session.items.index(item) + 1 :]
    for name in used:
        if not any(name in other.fixturenames for other in later):
            stops.pop(name)()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[TEST_BEGUN] = time.monotonic()
    item.stash[ATTEMPT_FAILED] = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    """A failed test's report says how long the machine stalled while it ran, and what else
    the stall watch saw (late wake-ups, I/O stalls: information, never a rerun)."""
    if call.excinfo is None:
        return
    item.stash[ATTEMPT_FAILED] = True
    stalls = item.config.stash[STALL_WATCH].since(item.stash.get(TEST_BEGUN, 0.0))
    if stalls:
        item.add_report_section(call.when, "machine stalls", describe(stalls))


@pytest.fixture(scope="session", autouse=True)
def early_starts(request: pytest.FixtureRequest) -> None:
    """Starts the session's heavy processes this run uses (EARLY_STARTS) before its first
    test: each loads (vLLM takes ~40 s on 2 cores) while the tests before its first user run,
    and each fixture that hands one to a test waits for it to serve."""
    for name in request.config.stash.get(EARLY, []):
        # One that skips (a model `make setup` makes is missing) skips its own tests alone.
        with contextlib.suppress(pytest.skip.Exception):
            request.getfixturevalue(name)


# Spans leave a service 100 ms after they end, so tests see them soon (the default is 5 s).
OTLP_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture(scope="session")
def otlp_collector() -> Iterator[OtlpCollector]:
    """A real OTLP/gRPC receiver every traced test process exports its spans to."""
    collector = OtlpCollector()
    collector.start()
    try:
        yield collector
    finally:
        collector.stop()


@pytest.fixture(scope="session")
def mesh_started(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalMesh]:
    """supervisord, control plane, Envoy, 2 gateways (their endpoint picker on), 2 workers, the
    reranker, and Prometheus when its binary is on PATH, on free ports with their own run
    directory: started (still loading: `mesh` waits for it)."""
    settings = LocalMeshSettings.on_free_ports(
        tmp_path_factory.mktemp("mesh"),
        gateways=2,
        workers=2,
        ready_timeout_seconds=600,
        # For test_prefix_routing's Envoy with worker_routing picker.
        picker_feed=True,
    )
    with started_mesh(settings) as local_mesh:
        request.config.stash[MESH_KEY] = local_mesh

        def stop() -> None:
            local_mesh.down()
            del request.config.stash[MESH_KEY]

        stop_after_last_user(request.config, "mesh_started", stop)
        yield local_mesh


@pytest.fixture(scope="session")
def mesh(mesh_started: LocalMesh) -> LocalMesh:
    return ready_mesh(mesh_started)


@pytest.fixture(scope="session")
def worker_started(otlp_collector: OtlpCollector) -> Iterator[ServiceProcess]:
    """The session's worker, started (still loading: `worker` waits for it)."""
    if not (TINY_MODEL / "config.json").exists():
        pytest.fail(f"no tiny model at {TINY_MODEL}: run `make setup` first")
    # Traced, so its spans join the traces of tests/integration/test_tracing.py; an engine
    # argument of vLLM's own, which test_worker_lifecycle.py finds in vLLM's configuration.
    process = worker_process(
        LOG_DIR,
        otlp_endpoint=otlp_collector.address,
        engine_args=json.dumps(WORKER_ENGINE_ARGS),
    )
    process.env.update(OTLP_ENV)
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def worker(worker_started: ServiceProcess) -> ServiceProcess:
    worker_started.wait_serving(WORKER_START_TIMEOUT)
    return worker_started


@pytest.fixture(scope="session")
async def worker_channel(worker: ServiceProcess) -> AsyncIterator[aio.Channel]:
    async with aio.insecure_channel(worker.address) as channel:
        yield channel


@pytest.fixture(scope="session")
def inference(worker_channel: aio.Channel) -> inference_pb2_grpc.InferenceServiceStub:
    return inference_pb2_grpc.InferenceServiceStub(worker_channel)


@pytest.fixture(scope="session")
def reranker_started(otlp_collector: OtlpCollector) -> Iterator[ServiceProcess]:
    process = reranker_process(LOG_DIR, otlp_endpoint=otlp_collector.address)
    process.env.update(OTLP_ENV)
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def reranker(reranker_started: ServiceProcess) -> ServiceProcess:
    reranker_started.wait_serving(RERANKER_START_TIMEOUT)
    return reranker_started


@pytest.fixture
async def fake_consul() -> AsyncIterator[FakeConsul]:
    """An in-process fake of Consul's agent and health HTTP API (tests/consul_fake.py)."""
    consul = FakeConsul()
    await consul.start()
    try:
        yield consul
    finally:
        await consul.stop()
