"""The local mesh under supervisord: the up, down, status and logs commands (`make up`)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import yaml

from tokenmesh.localmesh.certs import ENVOY_CLIENT, CertMaker, CertSettings
from tokenmesh.localmesh.configs import endpoints, prometheus_config, supervisord_config
from tokenmesh.localmesh.layout import ALERT_RULES, MeshFiles, Tools
from tokenmesh.localmesh.probes import envoy_host_statuses, envoy_hosts, health, http_ok
from tokenmesh.localmesh.programs import ProcessTable, Program, mesh_cores
from tokenmesh.localmesh.relay_module import build_relay_module
from tokenmesh.localmesh.settings import (
    ADAPTER_POOL,
    MAX_REPLICAS,
    REPLICATED_PORTS,
    LocalMeshSettings,
)
from tokenmesh.meshconfig.bootstrap import render, secret_files

# Names other code imports from here.
__all__ = [
    "ALERT_RULES",
    "MAX_REPLICAS",
    "REPLICATED_PORTS",
    "LocalMesh",
    "LocalMeshSettings",
    "Program",
    "envoy_host_statuses",
    "envoy_hosts",
]


class LocalMesh:
    """The supervisord-managed local mesh rooted at the repository."""

    def __init__(self, settings: LocalMeshSettings, root: Path, tools: Tools | None = None) -> None:
        # Decided once for every process: the default pool's workers and the adapter's pool.
        self.settings, why_not = settings.resolved()
        # Why the adapter has no pool of its own, when one was asked for (adapter_pool).
        self.adapter_note = why_not if settings.adapter_pool else ""
        settings = self.settings
        self.root = root
        self.files = files = MeshFiles.of(settings, root)
        self.tools = tools or Tools.on_this_machine()
        self.table = ProcessTable(settings, files, self.tools)
        self.programs = self.table.programs()
        # The paths tests and tools read.
        self.run_dir, self.log_dir, self.certs = files.run_dir, files.log_dir, files.certs
        self.envoy_config_path, self.endpoints_path = files.envoy_config, files.endpoints
        self.settings_path = files.settings
        # When start() started supervisord (ready_timeout_seconds counts from it).
        self._started = time.monotonic()

    @property
    def prometheus_url(self) -> str:
        return self.table.prometheus_url

    @property
    def tls(self) -> bool:
        """The mesh uses certificates (TLS at the edge, mTLS inside, or both)."""
        return self.settings.tls or self.settings.mtls

    def ensure_certs(self) -> bool:
        """Make the CA and certificates unless a valid set is there; True if one was made."""
        settings = CertSettings(dir=self.certs.dir, edge_names=self.settings.tls_edge_names)
        return CertMaker(settings, self.certs).ensure()

    def client_credentials(self) -> grpc.ChannelCredentials:
        """What Envoy presents to the services (mTLS): its client certificate, and the CA."""
        return grpc.ssl_channel_credentials(
            self.certs.ca_cert.read_bytes(),
            self.certs.key(ENVOY_CLIENT).read_bytes(),
            self.certs.cert(ENVOY_CLIENT).read_bytes(),
        )

    def serving(self, program: Program) -> bool:
        return self.health(program) == "SERVING"

    def health(self, program: Program) -> str:
        """The program's overall grpc.health.v1 status, over mTLS when its port wants it."""
        assert program.port is not None
        return health(program.address, self.client_credentials() if program.mtls else None)

    def mesh_cores(self, workers: int, cores: int) -> str:
        """The cores the mesh's own processes get ("1", "2-7"): those no engine binds."""
        return mesh_cores(self.settings, workers, cores)

    def endpoints(self) -> dict[str, dict[str, list[str]]]:
        """The static discovery file: every service replica's address, by cluster."""
        return endpoints(self.programs)

    def prometheus_config(self) -> dict[str, Any]:
        s = self.settings
        return prometheus_config(
            self.programs, self.files, s.envoy_admin_port, s.prometheus_scrape_interval_seconds
        )

    def supervisord_config(self) -> str:
        return supervisord_config(self.programs, self.files)

    def write_configs(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.files.supervisord_config.write_text(self.supervisord_config())
        mesh = self.settings.mesh(self.certs if self.tls else None)
        if mesh.relays:
            build_relay_module(self.files.relay_source, self.files.relay_module_dir)
        self.envoy_config_path.write_text(yaml.safe_dump(render(mesh), sort_keys=False))
        for path, secret in secret_files(mesh).items():
            Path(path).write_text(yaml.safe_dump(secret, sort_keys=False))
        self.endpoints_path.write_text(yaml.safe_dump(self.endpoints(), sort_keys=False))
        self.files.prometheus_config.write_text(
            yaml.safe_dump(self.prometheus_config(), sort_keys=False)
        )
        self.settings_path.write_text(self.settings.model_dump_json(indent=1))

    def supervisord_pid(self) -> int | None:
        """The pid of our running supervisord, or None."""
        try:
            pid = int(self.files.supervisord_pid.read_text().strip())
            os.kill(pid, 0)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            return None
        return pid

    def program(self, name: str) -> Program:
        return next(program for program in self.programs if program.name == name)

    def replicas(self, service: str) -> list[Program]:
        """The programs of one Envoy cluster (a service's; a worker pool's), in order."""
        return [program for program in self.programs if program.cluster == service]

    def pid(self, name: str) -> int:
        """The program's pid from supervisord; 0 when it is not running."""
        text = self.ctl("pid", name).stdout.strip()
        return int(text) if text.isdigit() else 0

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                str(self.tools.bin_dir / "supervisorctl"),
                "-c",
                str(self.files.supervisord_config),
                *args,
            ],
            capture_output=True,
            text=True,
            check=False,
        )

    def up(self) -> int:
        if self.supervisord_pid() is not None:
            print("the local mesh is already running (make status / make down)")
            return self.status()
        self.start()
        return self.wait_ready()

    def start(self) -> None:
        """Write the mesh's files and start supervisord, which starts every program; returns
        at once (wait_ready waits for them)."""
        if self.tools.consul:
            print(f"consul found at {self.tools.consul}: dev agent on {self.table.consul_address}")
        else:
            print("no consul binary on PATH: discovery is static (.run/endpoints.yaml)")
        if not self.tools.prometheus:
            print("no prometheus binary on PATH: no metrics storage or alerts (make setup)")
        if ADAPTER_POOL in self.settings.pools:
            adapters = ", ".join(self.settings.pools[ADAPTER_POOL].lora_modules)
            print(f"serving the adapter {adapters} on a worker pool of its own ({ADAPTER_POOL})")
        elif self.adapter_note:
            print(f"no adapter pool: {self.adapter_note}")
        if self.tls:
            made = self.ensure_certs()
            print(f"{'made' if made else 'using'} TLS certificates in {self.certs.dir}")
        self.write_configs()
        subprocess.run(
            [str(self.tools.bin_dir / "supervisord"), "-c", str(self.files.supervisord_config)],
            check=True,
            cwd=self.root,
        )
        print(f"started under supervisord; logs in {self.log_dir} (make logs)")
        self._started = time.monotonic()

    def wait_ready(self) -> int:
        """Wait until every program serves and Envoy sees every replica healthy (at most
        ready_timeout_seconds from the start): 0, or 1 with the log of the one that is not."""
        started = self._started
        deadline = started + self.settings.ready_timeout_seconds
        for program in self.programs:
            if program.port is not None:
                ready = partial(self.serving, program)
            elif program.ready_url is not None:
                ready = partial(http_ok, program.ready_url)
            else:
                continue
            if not self._wait(program, deadline, ready):
                return 1
        envoy = next(program for program in self.programs if program.name == "envoy")
        if not self._wait(envoy, deadline, self.envoy_ready):
            return 1
        print(f"ready in {time.monotonic() - started:.0f}s\n")
        self._print_endpoints()
        return 0

    def _wait(self, program: Program, deadline: float, ready: Callable[[], bool]) -> bool:
        print(f"waiting for {program.name} ...", flush=True)
        while time.monotonic() < deadline:
            state = self.ctl("status", program.name).stdout.split()
            if len(state) > 1 and state[1] in ("FATAL", "EXITED", "BACKOFF"):
                print(f"{program.name} is {state[1]}; last log lines:\n{self._tail(program)}")
                return False
            if ready():
                print(f"{program.name} is ready")
                return True
            time.sleep(1)
        print(f"{program.name} not ready in time; last log lines:\n{self._tail(program)}")
        return False

    def envoy_hosts(self) -> dict[str, list[tuple[str, bool]]]:
        """Envoy's view: (address, healthy) of each host, by cluster."""
        return envoy_hosts(self.settings.envoy_admin_port)

    def envoy_ready(self) -> bool:
        """Every service replica is known to Envoy and passes its health checks."""
        hosts = self.envoy_hosts()
        expected = self.endpoints()["clusters"]
        return all(
            sorted(address for address, healthy in hosts.get(cluster, []) if healthy)
            == sorted(addresses)
            for cluster, addresses in expected.items()
        )

    def _tail(self, program: Program, lines: int = 30) -> str:
        log = self.log_dir / f"{program.name}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _print_endpoints(self) -> None:
        s = self.settings
        scheme = "https" if s.tls else "http"
        edge_tls = f" (TLS only, CA {self.certs.ca_cert})" if s.tls else ""
        print(f"  edge (Envoy)  grpc, gRPC-Web, REST  127.0.0.1:{s.edge_port}{edge_tls}")
        print(f"  ops page      {scheme}://127.0.0.1:{s.edge_port}/ops/")
        print(f"  Envoy admin   http://127.0.0.1:{s.envoy_admin_port}/clusters")
        print(f"  Envoy stats   http://127.0.0.1:{s.envoy_admin_port}/stats/prometheus")
        if self.tools.prometheus:
            print(f"  Prometheus    {self.prometheus_url} (alerts: {self.prometheus_url}/alerts)")
        for program in self.programs:
            if program.port is not None:
                print(
                    f"  {program.name:13} grpc {program.address}"
                    f"{' (mTLS)' if program.mtls else ''}   metrics http://127.0.0.1:{program.metrics_port}/metrics"
                )
        edge = f"127.0.0.1:{s.edge_port}"
        # With keys on, the examples send a key from $TOKENMESH_KEY (double quotes: expanded).
        header = ""
        if self.files.keys is not None:
            print(f"\nAPI keys on: {self.files.keys}")
            print("  add one: python -m tokenmesh.gateway.keys add --tenant NAME --file FILE")
            header = ' -H "authorization: Bearer $TOKENMESH_KEY"'
        # With TLS the examples trust the local CA instead of speaking plaintext.
        grpcurl_tls = f"-cacert {self.certs.ca_cert}" if s.tls else "-plaintext"
        curl_tls = f" --cacert {self.certs.ca_cert}" if s.tls else ""
        print("\nTry it:")
        print(
            f"  grpcurl {grpcurl_tls}{header} -d "
            + shlex.join(['{"prompt":"hello","max_tokens":16}', edge])
            + " tokenmesh.v1.LLMService/Generate"
        )
        print(
            f'  curl -N{curl_tls}{header} -d \'{{"prompt":"hello","max_tokens":16}}\' '
            f"{scheme}://{edge}/tokenmesh.v1.LLMService/Generate"
        )
        body = json.dumps(
            {"model": Path(s.model).name, "messages": [{"role": "user", "content": "hello"}],
             "max_tokens": 16, "stream": True}
        )  # fmt: skip
        print(
            f"  curl -N{curl_tls}{header} -H 'content-type: application/json' -d '{body}' "
            f"{scheme}://{edge}/v1/chat/completions"
        )
        # Every further pool's model and every adapter: `model` names it.
        served = [
            *s.lora_modules,
            *(name for _, pool in s.worker_pools()[1:] for name in pool.lora_modules),
            *{Path(pool.model).name for _, pool in s.worker_pools()[1:]} - {Path(s.model).name},
        ]
        for adapter in served:
            print(
                f"  curl{curl_tls}{header} -H 'content-type: application/json' -d "
                + shlex.quote(json.dumps({"model": adapter, "prompt": "hello", "max_tokens": 16}))
                + f" {scheme}://{edge}/v1/completions"
            )
        print(
            f"  (grpcurl is in {self.tools.bin_dir}; `source .venv/bin/activate` puts it on PATH)"
        )

    def down(self) -> int:
        pid = self.supervisord_pid()
        if pid is None:
            print("the local mesh is not running")
            return 0
        # Every program at once (stop all signals each, then waits for all), then supervisord:
        # its own shutdown stops one program after another, each waiting for the last to
        # drain (a worker's engine takes seconds to end).
        self.ctl("stop", "all")
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
            print("the local mesh is not running (make up)")
            return 0
        print(self.ctl("status").stdout.rstrip())
        for program in self.programs:
            if program.port is not None:
                print(f"  {program.name:13} health: {self.health(program)}")
            elif program.ready_url is not None:
                state = "ready" if http_ok(program.ready_url) else "NOT READY"
                print(f"  {program.name:13} {state} ({program.ready_url})")
        for cluster, hosts in sorted(self.envoy_hosts().items()):
            listed = ", ".join(f"{a} {'healthy' if ok else 'UNHEALTHY'}" for a, ok in hosts)
            print(f"  envoy cluster {cluster:10} {listed or 'no hosts'}")
        return 0

    def logs(self) -> int:
        files = sorted(str(path) for path in self.log_dir.glob("*.log"))
        if not files:
            print("no logs yet (make up)")
            return 0
        os.execvp("tail", ["tail", "-n", "50", "-F", *files])
