"""Helpers for tests that run real service processes on free local ports."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "models" / "tiny-llama"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def health_status(address: str, timeout: float = 1.0) -> str:
    """SERVING / NOT_SERVING / ..., or the gRPC error code name when the check fails."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as err:
            return str(err.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


@dataclass
class ServiceProcess:
    """A service started as `python -m <module>` with its settings in the environment."""

    module: str
    env: dict[str, str]
    log_path: Path
    port: int
    metrics_port: int
    process: subprocess.Popen[bytes] | None = None
    # Every distinct health status seen while waiting for readiness, in order.
    health_history: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

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

    def wait_serving(self, timeout: float) -> None:
        """Poll health until SERVING, recording the statuses seen; fail on exit or timeout."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.module} exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            status = health_status(self.address)
            if not self.health_history or self.health_history[-1] != status:
                self.health_history.append(status)
            if status == "SERVING":
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.module} not SERVING after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the whole process group (vLLM's children too)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        return self.process.returncode


def worker_process(log_dir: Path, name: str = "worker", **overrides: str) -> ServiceProcess:
    """A worker on the tiny model with free ports; overrides are TOKENMESH_WORKER_* values."""
    port, metrics_port = free_port(), free_port()
    env = {
        "TOKENMESH_WORKER_PORT": str(port),
        "TOKENMESH_WORKER_METRICS_PORT": str(metrics_port),
        "TOKENMESH_WORKER_MODEL": str(TINY_MODEL),
        "TOKENMESH_WORKER_LOG_FORMAT": "text",
        "TOKENMESH_WORKER_GRACE_SECONDS": "5",
        "TOKENMESH_WORKER_KV_CACHE_SPACE_GIB": "1",
    }
    env.update({f"TOKENMESH_WORKER_{key.upper()}": value for key, value in overrides.items()})
    return ServiceProcess(
        module="tokenmesh.worker",
        env=env,
        log_path=log_dir / f"{name}.log",
        port=port,
        metrics_port=metrics_port,
    )


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list:  # type: ignore[type-arg]
    """Read a stream to its end with read() (a call read once with read() cannot be iterated)."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages
