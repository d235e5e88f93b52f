"""Several front ends over one engine (settings.frontends > 1), as `vllm serve
--api-server-count N` runs its API servers: this process, the supervisor, binds the engine's
client listeners, starts the engine's processes with vLLM's own launcher, and spawns N front
ends, each a whole worker servicer (app.serve) over a client of the one engine. They share the
gRPC port (SO_REUSEPORT) and, in shared memory, the engine's load and step clock. The
supervisor serves the worker's metrics port (the engine's gauges and every front end's series,
labelled frontend), keeps its Consul registration, places the engine core, and ends them all
together (docs/decisions/0026-several-front-ends-over-one-engine.md)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from multiprocessing.process import BaseProcess
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.usage.usage_lib import UsageContext
from vllm.utils.system_utils import set_process_title
from vllm.v1.engine.utils import bind_engine_zmq_listeners, launch_core_engines
from vllm.v1.executor import Executor

from tokenmesh.common.logs import configure_logging
from tokenmesh.common.metrics import MetricsEndpoint
from tokenmesh.common.registration import ConsulRegistration, instance_for
from tokenmesh.common.server import run, wait_for_shutdown_signal
from tokenmesh.worker.app import register_engine_gauges, serve
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine import configure_vllm_environment
from tokenmesh.worker.engine_state import EngineLoad, EngineShare, shared_step_clock
from tokenmesh.worker.gathered_metrics import FrontendMetrics
from tokenmesh.worker.placement import descendants, place_engine

log = logging.getLogger(__name__)

# After SIGTERM, how long past their grace the front ends get before they are killed.
STOP_MARGIN_SECONDS = 10.0


def claim_port(host: str, port: int) -> int:
    """The port the front ends will share: `port` once it is known to be free (bound here
    without SO_REUSEPORT, so a stale worker that holds it stops this one, as a single process
    would be stopped), or a free one for port 0."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, port))
        return int(probe.getsockname()[1])


def run_frontend(settings: WorkerSettings, arguments: AsyncEngineArgs, share: EngineShare) -> None:
    """A front end's process (spawned): the worker's servicer over its client of the engine."""
    # What `ps` calls it, as vLLM names its API servers (VLLM::TokenmeshFrontend_<index>).
    set_process_title("TokenmeshFrontend", str(share.index))
    configure_logging(settings.log_level, settings.log_format)
    sys.exit(run(serve(settings, arguments, share)))


class Supervisor:
    """Starts the engine and the front ends, and watches them until a signal or a death."""

    def __init__(self, settings: WorkerSettings, arguments: AsyncEngineArgs) -> None:
        self._settings = settings
        self._arguments = arguments
        self._context = multiprocessing.get_context("spawn")
        self.frontends: list[BaseProcess] = []
        self._engine: Any = None  # vLLM's CoreEngineProcManager once started
        self.load = EngineLoad.shared(self._context)
        self._steps = shared_step_clock(self._context)
        self._ports = self._context.RawArray("i", settings.frontends)
        self._admitted = self._context.Value("q", 0)

    def start(self) -> None:
        """Launch the engine's processes and the front ends; returns once the engine is up
        (vLLM's launcher waits for its handshake, and stops if a front end dies first)."""
        settings, count = self._settings, self._settings.frontends
        configure_vllm_environment(settings)
        arguments = copy.copy(self._arguments)
        arguments._api_process_count, arguments._api_process_rank = count, -1
        config = arguments.create_engine_config(UsageContext.OPENAI_API_SERVER)
        listeners = bind_engine_zmq_listeners(config, count)
        # Stats always: the front ends' load reports and stall watchdogs read them.
        with launch_core_engines(
            config, Executor.get_class(config), True, listeners.addresses
        ) as launch:
            pairs = zip(listeners.inputs, listeners.outputs, strict=True)
            for index, (inputs, outputs) in enumerate(pairs):
                client = {
                    "input_address": inputs.address,
                    "output_address": outputs.address,
                    "input_listener": inputs.socket,
                    "output_listener": outputs.socket,
                    "client_count": count,
                    "client_index": index,
                }
                share = EngineShare(
                    index, count, client, self.load, self._steps, self._ports, self._admitted
                )
                process = self._context.Process(
                    target=run_frontend,
                    args=(settings, self._arguments, share),
                    name=f"tokenmesh-frontend-{index}",
                )
                process.start()
                self.frontends.append(process)
                # The front end owns them now.
                inputs.close()
                outputs.close()
            launch.watched_frontend_processes = self.frontends
        self._engine = launch.engine_manager
        # The engine core onto the runner's cores, the front ends left on the worker's.
        place_engine(settings.engine_affinity, exclude=self.frontend_pids())
        log.info(
            "worker engine started with front ends",
            extra={"frontends": [p.pid for p in self.frontends], "port": settings.port},
        )

    def frontend_pids(self) -> set[int]:
        pids = {p.pid for p in self.frontends if p.pid is not None}
        return pids | {child for pid in pids for child in descendants(pid)}

    def live_frontends(self) -> list[BaseProcess]:
        return [p for p in self.frontends if p.exitcode is None]

    def engine_ended(self) -> dict[str, int]:
        """The engine's processes that have ended, with their exit codes."""
        return self._engine.finished_procs() if self._engine is not None else {}

    def metrics_ports(self) -> list[int]:
        return [self._ports[i] if p.exitcode is None else 0 for i, p in enumerate(self.frontends)]

    def stop(self, grace: float) -> None:
        """SIGTERM every front end (each drains its streams within `grace`), kill those still
        running after the margin, then shut the engine down; blocks. With the engine dead there
        is nothing to drain: the front ends are killed at once, and their callers' streams end
        with the connection instead of waiting out the grace for tokens that cannot come."""
        if self.engine_ended():
            for process in self.live_frontends():
                process.kill()
        for process in self.live_frontends():
            os.kill(process.pid, signal.SIGTERM)  # type: ignore[arg-type]
        ends_by = time.monotonic() + grace + STOP_MARGIN_SECONDS
        for process in self.frontends:
            process.join(max(0.0, ends_by - time.monotonic()))
            if process.exitcode is None:
                log.error("front end did not stop; killing it", extra={"pid": process.pid})
                process.kill()
                process.join()
        if self._engine is not None:
            self._engine.shutdown(timeout=STOP_MARGIN_SECONDS)

    async def watch(self, stop: asyncio.Event, interval: float) -> int:
        """Until a signal (exit 0), the engine's death or the last front end's (exit 1). A
        front end that dies is not replaced (vLLM's engine greets each client once, when it
        starts): the others go on serving, and the frontends gauge shows it."""
        known_dead: set[int] = set()
        while not stop.is_set():
            if ended := self.engine_ended():
                log.error("inference engine died; stopping the worker", extra={"ended": ended})
                return 1
            for process in self.frontends:
                if process.exitcode is not None and process.pid not in known_dead:
                    known_dead.add(process.pid)  # type: ignore[arg-type]
                    log.error(
                        "front end ended; the others go on serving",
                        extra={"pid": process.pid, "exit_code": process.exitcode},
                    )
            if not self.live_frontends():
                log.error("every front end has ended; stopping the worker")
                return 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
        return 0


def serve_frontends(settings: WorkerSettings, arguments: AsyncEngineArgs) -> int:
    """Run the worker as a supervisor of settings.frontends front ends until SIGTERM/SIGINT
    (exit 0) or until its engine or every front end dies (exit 1)."""
    settings = settings.model_copy(update={"port": claim_port(settings.host, settings.port)})
    supervisor = Supervisor(settings, arguments)
    # On the main thread, which lives as long as the process: the kernel ends each child when
    # the thread that started it ends (lifetime.py). A signal during the engine's load ends
    # the process, and its children with it.
    supervisor.start()
    return run(supervise(settings, supervisor))


async def supervise(settings: WorkerSettings, supervisor: Supervisor) -> int:
    stop = asyncio.Event()
    signals = asyncio.create_task(wait_for_shutdown_signal(stop))
    registry = CollectorRegistry()
    register_engine_gauges(registry, supervisor.load)
    Gauge(
        "tokenmesh_worker_frontends",
        "The worker's front-end processes alive (of the frontends setting).",
        registry=registry,
    ).set_function(lambda: len(supervisor.live_frontends()))
    registry.register(FrontendMetrics(supervisor.metrics_ports))
    metrics = MetricsEndpoint(registry, settings.metrics_host, settings.metrics_port)
    metrics_port = metrics.start()
    meta = {"model": settings.model_name}
    registration = ConsulRegistration(
        settings.consul_http_addr,
        instance_for(settings, "worker", settings.port, metrics_port, meta),
    )
    registration.start()
    try:
        code = await supervisor.watch(stop, settings.engine_check_interval_seconds)
    finally:
        signals.cancel()
        await registration.stop()
        await asyncio.to_thread(supervisor.stop, settings.grace_seconds)
        metrics.stop()
    log.info("worker stopped", extra={"exit_code": code})
    return code
