"""The files a local mesh runs from, written from its process table: supervisord's config,
Prometheus' config and the static discovery file."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from tokenmesh.localmesh.layout import MeshFiles
from tokenmesh.localmesh.programs import Program

# prometheus_client (0.26) writes vLLM's `vllm:*` sample names as `vllm_*` when Prometheus asks
# for OpenMetrics (as 2.x does); this puts back the names vLLM documents and the dashboards use.
VLLM_METRIC_NAMES = {
    "source_labels": ["__name__"],
    "regex": "vllm_(.+)",
    "target_label": "__name__",
    "replacement": "vllm:$1",
}
# supervisord strips these from both ends of a value.
QUOTES = ("'", '"')
# What supervisord's config parser would take for an inline comment.
INLINE_COMMENT = re.compile(r"\s[;#]")


def endpoints(programs: Sequence[Program]) -> dict[str, dict[str, list[str]]]:
    """The static discovery file: every service replica's address, by cluster."""
    clusters: dict[str, list[str]] = {"gateway": [], "worker": [], "reranker": []}
    openai = []
    for program in programs:
        if program.service in clusters and program.cluster is not None:
            clusters.setdefault(program.cluster, []).append(program.address)
        if program.openai_port is not None:
            openai.append(f"127.0.0.1:{program.openai_port}")
    if openai:
        clusters["openai"] = openai
    return {"clusters": clusters}


def prometheus_config(
    programs: Sequence[Program], files: MeshFiles, envoy_admin_port: int, interval_seconds: int
) -> dict[str, Any]:
    """Scrape every service replica (job and `service` label: its service; `replica`: its
    program name) and Envoy's admin stats; evaluate the alert rules."""
    interval = f"{interval_seconds}s"
    jobs: dict[str, list[dict[str, Any]]] = {}
    for program in programs:
        if program.service is not None and program.metrics_port is not None:
            jobs.setdefault(program.service, []).append(
                {
                    "targets": [f"127.0.0.1:{program.metrics_port}"],
                    # address: the gRPC address, which the ops feed knows replicas by.
                    "labels": {
                        "service": program.service,
                        "replica": program.name,
                        "address": program.address,
                    },
                }
            )
    scrape_configs: list[dict[str, Any]] = [
        {"job_name": service, "static_configs": targets} for service, targets in jobs.items()
    ]
    for job in scrape_configs:
        if job["job_name"] == "worker":
            job["metric_relabel_configs"] = [VLLM_METRIC_NAMES]
    scrape_configs.append(
        {
            "job_name": "envoy",
            "metrics_path": "/stats/prometheus",
            "static_configs": [
                {
                    "targets": [f"127.0.0.1:{envoy_admin_port}"],
                    "labels": {"service": "envoy", "replica": "envoy"},
                }
            ],
        }
    )
    return {
        # The timeout may not exceed the interval (Prometheus' default timeout is 10 s).
        "global": {
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "evaluation_interval": interval,
        },
        "rule_files": [str(files.alert_rules)],
        "scrape_configs": scrape_configs,
    }


def supervisor_environment(env: Mapping[str, str]) -> str:
    """env as supervisord reads an `environment=` value: its parser (shlex, not POSIX) knows no
    escapes, so a value goes in double quotes, or in single ones when it holds a double quote
    (JSON); % is doubled (supervisord expands %(name)s). ValueError for what it cannot carry."""
    pairs = []
    for key, value in env.items():
        quote = "'" if '"' in value else '"'
        if (
            quote in value
            or "\n" in value
            or value.startswith(QUOTES)
            or value.endswith(QUOTES)
            or INLINE_COMMENT.search(value)
        ):
            raise ValueError(f"supervisord cannot pass {key}={value!r}")
        pairs.append(f"{key}={quote}{value.replace('%', '%%')}{quote}")
    return ",".join(pairs)


def supervisord_config(programs: Sequence[Program], files: MeshFiles) -> str:
    sections = [
        f"""[unix_http_server]
file={files.run_dir}/supervisor.sock

[supervisord]
logfile={files.log_dir}/supervisord.log
pidfile={files.supervisord_pid}
directory={files.root}
childlogdir={files.log_dir}

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://{files.run_dir}/supervisor.sock
"""
    ]
    for program in programs:
        environment = f"environment={supervisor_environment(program.env)}\n" if program.env else ""
        sections.append(
            f"""[program:{program.name}]
command={shlex.join(program.command)}
{environment}autorestart=true
startsecs=2
stopsignal=TERM
stopwaitsecs={program.stop_wait_seconds}
stopasgroup=true
killasgroup=true
redirect_stderr=true
stdout_logfile={files.log_dir}/{program.name}.log
stdout_logfile_maxbytes=50MB
stdout_logfile_backups=2
"""
        )
    return "\n".join(sections)
