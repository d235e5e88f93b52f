"""Where a local mesh keeps its files, and the programs this machine offers it."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from tokenmesh.localmesh.certs import CertPaths
from tokenmesh.localmesh.relay_module import RELAY_SOURCE
from tokenmesh.localmesh.settings import LocalMeshSettings

# The alert rules Prometheus evaluates, relative to the repository (the Helm chart ships the
# same file).
ALERT_RULES = Path("prometheus") / "alerts.yml"
# The built ops page (`make ops-page`), relative to the repository; the control plane serves it.
OPS_PAGE_DIR = Path("ops") / "dist"


@dataclass(frozen=True)
class MeshFiles:
    """The mesh's generated configs, logs and certificates (under run_dir) and the repository
    files it reads; every path absolute."""

    root: Path
    run_dir: Path
    log_dir: Path
    certs: CertPaths
    # The gateways' keys file (None: authentication off).
    keys: Path | None
    # The control plane's adapter admin keys (None: the admin API off).
    admin_keys: Path | None
    supervisord_config: Path
    supervisord_pid: Path
    envoy_config: Path
    # The static discovery file the control plane reads when there is no Consul.
    endpoints: Path
    prometheus_config: Path
    # The settings the mesh runs with, so tools can attach to it (e.g. `make chaos`).
    settings: Path
    alert_rules: Path
    ops_page: Path
    # The edge's stream relay: its source, and where it is built for Envoy to load.
    relay_source: Path
    relay_module_dir: Path

    @classmethod
    def of(cls, settings: LocalMeshSettings, root: Path) -> MeshFiles:
        run_dir = (root / settings.run_dir).resolve()
        keys, admin_keys = settings.keys_file, settings.admin_keys_file
        return cls(
            root=root,
            run_dir=run_dir,
            log_dir=run_dir / "logs",
            certs=CertPaths((root / (settings.certs_dir or settings.run_dir / "certs")).resolve()),
            keys=None if keys is None else (root / keys).resolve(),
            admin_keys=None if admin_keys is None else (root / admin_keys).resolve(),
            supervisord_config=run_dir / "supervisord.conf",
            supervisord_pid=run_dir / "supervisord.pid",
            envoy_config=run_dir / "envoy.yaml",
            endpoints=run_dir / "endpoints.yaml",
            prometheus_config=run_dir / "prometheus.yml",
            settings=run_dir / "mesh-settings.json",
            alert_rules=(root / ALERT_RULES).resolve(),
            ops_page=(root / OPS_PAGE_DIR).resolve(),
            relay_source=(root / RELAY_SOURCE).resolve(),
            relay_module_dir=run_dir / "envoy-modules",
        )


@dataclass(frozen=True)
class Tools:
    """The interpreter (its bin directory holds envoy, supervisord and grpcurl), the optional
    programs found on PATH, and the cores the mesh shares."""

    python: str
    consul: str | None
    prometheus: str | None
    taskset: bool
    cores: int

    @classmethod
    def on_this_machine(cls) -> Tools:
        return cls(
            python=sys.executable,
            consul=shutil.which("consul"),
            prometheus=shutil.which("prometheus"),
            taskset=shutil.which("taskset") is not None,
            cores=os.cpu_count() or 1,
        )

    @property
    def bin_dir(self) -> Path:
        return Path(self.python).parent
