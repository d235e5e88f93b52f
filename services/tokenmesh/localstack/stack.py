"""What the local stack runs, the supervisord config for it, and the up/down/status commands."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class StackSettings(BaseSettings):
    """Ports and model of the local stack, from TOKENMESH_STACK_* variables."""

    model_config = SettingsConfigDict(env_prefix="TOKENMESH_STACK_", frozen=True, extra="ignore")

    # Where supervisord keeps its socket, pid file and the services' logs.
    run_dir: Path = Path(".run")
    model: str = "models/tiny-llama"
    gateway_port: int = Field(default=50050, ge=1, le=65535)
    gateway_metrics_port: int = Field(default=9450, ge=1, le=65535)
    worker_port: int = Field(default=50061, ge=1, le=65535)
    worker_metrics_port: int = Field(default=9461, ge=1, le=65535)
    reranker_port: int = Field(default=50071, ge=1, le=65535)
    reranker_metrics_port: int = Field(default=9471, ge=1, le=65535)
    # CPU KV cache per worker, GiB.
    worker_kv_cache_space_gib: int = Field(default=1, ge=1)
    # How long `up` waits for every service to report SERVING (model loads included).
    ready_timeout_seconds: float = Field(default=600.0, gt=0)


@dataclass(frozen=True)
class Program:
    """One supervised process: the tokenmesh service `name`, run as `python -m tokenmesh.<name>`
    with its TOKENMESH_<NAME>_* settings."""

    name: str
    port: int
    metrics_port: int
    # Settings beyond the ports, by name without the prefix (e.g. MODEL).
    settings: dict[str, str] = field(default_factory=dict)
    # Seconds supervisord waits after SIGTERM before SIGKILL: the grace period plus shutdown.
    stop_wait_seconds: int = 30

    @property
    def module(self) -> str:
        return f"tokenmesh.{self.name}"

    @property
    def env(self) -> dict[str, str]:
        prefix = f"TOKENMESH_{self.name.upper()}_"
        values = {"PORT": str(self.port), "METRICS_PORT": str(self.metrics_port), **self.settings}
        return {prefix + key: value for key, value in values.items()}


def programs(settings: StackSettings) -> list[Program]:
    """Dependencies first: `up` waits for each in this order."""
    return [
        Program(
            "worker",
            settings.worker_port,
            settings.worker_metrics_port,
            {
                "MODEL": settings.model,
                "KV_CACHE_SPACE_GIB": str(settings.worker_kv_cache_space_gib),
            },
        ),
        Program("reranker", settings.reranker_port, settings.reranker_metrics_port),
        Program(
            "gateway",
            settings.gateway_port,
            settings.gateway_metrics_port,
            {
                "WORKER_ADDRESS": f"127.0.0.1:{settings.worker_port}",
                "RERANKER_ADDRESS": f"127.0.0.1:{settings.reranker_port}",
            },
        ),
    ]


class Stack:
    """The supervisord-managed local stack rooted at the repository."""

    def __init__(self, settings: StackSettings, root: Path) -> None:
        self.settings = settings
        self.root = root
        self.run_dir = (root / settings.run_dir).resolve()
        self.log_dir = self.run_dir / "logs"
        self.config_path = self.run_dir / "supervisord.conf"
        self.pid_path = self.run_dir / "supervisord.pid"
        self.programs = programs(settings)
        self._bin = Path(sys.executable).parent

    def supervisord_config(self) -> str:
        sections = [
            f"""[unix_http_server]
file={self.run_dir}/supervisor.sock

[supervisord]
logfile={self.log_dir}/supervisord.log
pidfile={self.pid_path}
directory={self.root}
childlogdir={self.log_dir}

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://{self.run_dir}/supervisor.sock
"""
        ]
        for program in self.programs:
            env = ",".join(f'{key}="{value}"' for key, value in program.env.items())
            sections.append(
                f"""[program:{program.name}]
command={self._bin / "python"} -m {program.module}
environment={env}
autorestart=true
startsecs=5
stopsignal=TERM
stopwaitsecs={program.stop_wait_seconds}
stopasgroup=true
killasgroup=true
redirect_stderr=true
stdout_logfile={self.log_dir}/{program.name}.log
stdout_logfile_maxbytes=50MB
stdout_logfile_backups=2
"""
            )
        return "\n".join(sections)

    def supervisord_pid(self) -> int | None:
        """The pid of our running supervisord, or None."""
        try:
            pid = int(self.pid_path.read_text().strip())
            os.kill(pid, 0)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            return None
        return pid

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self._bin / "supervisorctl"), "-c", str(self.config_path), *args],
            capture_output=True,
            text=True,
            check=False,
        )

    def up(self) -> int:
        if self.supervisord_pid() is not None:
            print("the local stack is already running (make status / make down)")
            return self.status()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.supervisord_config())
        subprocess.run(
            [str(self._bin / "supervisord"), "-c", str(self.config_path)], check=True, cwd=self.root
        )
        print(f"started under supervisord; logs in {self.log_dir} (make logs)")
        started = time.monotonic()
        for program in self.programs:
            if not self._wait_serving(program, started + self.settings.ready_timeout_seconds):
                return 1
        print(f"ready in {time.monotonic() - started:.0f}s\n")
        self._print_endpoints()
        return 0

    def _wait_serving(self, program: Program, deadline: float) -> bool:
        print(f"waiting for {program.name} on 127.0.0.1:{program.port} ...", flush=True)
        while time.monotonic() < deadline:
            state = self.ctl("status", program.name).stdout.split()
            if len(state) > 1 and state[1] in ("FATAL", "EXITED", "BACKOFF"):
                print(f"{program.name} is {state[1]}; last log lines:\n{self._tail(program)}")
                return False
            if health(f"127.0.0.1:{program.port}") == "SERVING":
                print(f"{program.name} is SERVING")
                return True
            time.sleep(1)
        print(f"{program.name} not SERVING in time; last log lines:\n{self._tail(program)}")
        return False

    def _tail(self, program: Program, lines: int = 30) -> str:
        log = self.log_dir / f"{program.name}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _print_endpoints(self) -> None:
        for program in self.programs:
            print(
                f"  {program.name:10} grpc 127.0.0.1:{program.port}   "
                f"metrics http://127.0.0.1:{program.metrics_port}/metrics"
            )
        gateway = f"127.0.0.1:{self.settings.gateway_port}"
        calls = [
            ('{"prompt":"hello","max_tokens":16}', "Generate"),
            (
                '{"prompt":"What is the capital of France?","max_tokens":16,'
                '"documents":["Bananas are yellow.","Paris is the capital of France."]}',
                "GetAnswer",
            ),
        ]
        print("\nTry it:")
        for body, method in calls:
            command = ["grpcurl", "-plaintext", "-d", body, gateway]
            print("  " + shlex.join([*command, f"tokenmesh.v1.LLMService/{method}"]))
        print(f"  (grpcurl is in {self._bin}; `source .venv/bin/activate` puts it on PATH)")

    def down(self) -> int:
        pid = self.supervisord_pid()
        if pid is None:
            print("the local stack is not running")
            return 0
        result = self.ctl("shutdown")
        print(result.stdout.strip() or result.stderr.strip())
        deadline = time.monotonic() + 120
        while self.supervisord_pid() is not None and time.monotonic() < deadline:
            time.sleep(0.5)
        if self.supervisord_pid() is not None:
            print(f"supervisord (pid {pid}) did not stop in time")
            return 1
        print("stopped")
        return 0

    def status(self) -> int:
        if self.supervisord_pid() is None:
            print("the local stack is not running (make up)")
            return 0
        print(self.ctl("status").stdout.rstrip())
        for program in self.programs:
            print(f"  {program.name:10} health: {health(f'127.0.0.1:{program.port}')}")
        return 0

    def logs(self) -> int:
        files = sorted(str(path) for path in self.log_dir.glob("*.log"))
        if not files:
            print("no logs yet (make up)")
            return 0
        os.execvp("tail", ["tail", "-n", "50", "-F", *files])


def health(address: str) -> str:
    """The overall grpc.health.v1 status at address, or the error code name."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        except grpc.RpcError as err:
            return str(err.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
