"""Retry policies: what is retried, how often, and on which host (routes and gRPC services)."""

from __future__ import annotations

from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.constants import TYPE, Config

RETRY_ON = "unavailable,reset,connect-failure,refused-stream"
# A worker at its admission bound refuses at once with RESOURCE_EXHAUSTED: another worker may
# have room (not retried at the edge: every gateway shares the same workers).
OVERLOADED = ",resource-exhausted"
# An HTTP POST is not idempotent: retried only when it never reached the upstream.
NEVER_SENT = "connect-failure,reset-before-request"
# Retries go to another host: a host that just died still counts as healthy until its health
# checks fail (~1 s), and LEAST_REQUEST favours it (its streams are gone, so it looks idle), so
# without this every retry can land on the same dead host.
PREVIOUS_HOSTS = "envoy.retry_host_predicates.previous_hosts"
PREVIOUS_HOSTS_TYPE = TYPE + "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
# How often a retry may pick again when it lands on a previous host. LEAST_REQUEST draws two
# hosts with replacement and keeps the less busy, so with two workers the dead, idle one is
# drawn 3 times in 4: 5 picks still landed on it 1 time in 4 (0.75^5), 20 about 1 in 300.
HOST_SELECTION_ATTEMPTS = 20


def retry_policy(retry_on: str, mesh: MeshSettings) -> Config:
    """Retries on another host, with a short back-off (a route's, or a gRPC service's)."""
    return {
        "retry_on": retry_on,
        "num_retries": mesh.retry_attempts,
        "retry_back_off": {"base_interval": "0.025s", "max_interval": "0.25s"},
        "retry_host_predicate": [
            {"name": PREVIOUS_HOSTS, "typed_config": {"@type": PREVIOUS_HOSTS_TYPE}}
        ],
        "host_selection_retry_max_attempts": HOST_SELECTION_ATTEMPTS,
    }
