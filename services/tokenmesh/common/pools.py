"""Worker pools: each serves one base model (and its adapters) on workers of its own, as an
Envoy cluster of its own. The default pool is the cluster `worker`; a further pool `name` is
`worker-name`. The gateway names a request's pool in POOL_HEADER (none: the default), and
Envoy's routes to the workers (the edge's direct path, its stream relay, the gateways'
internal listener) send it to that pool's cluster; every other routing decision (prefix
hashing, the endpoint picker, retries, health checks, ejection) is the pool's own."""

from __future__ import annotations

import re
from collections.abc import Iterable

POOL_HEADER = "x-tokenmesh-pool"
WORKER_CLUSTER = "worker"
# A pool's name: part of a cluster's, a Kubernetes object's and a metric label's name.
POOL_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?")


def pool_cluster(pool: str) -> str:
    """The Envoy cluster of a pool's workers ("": the default pool's)."""
    return f"{WORKER_CLUSTER}-{pool}" if pool else WORKER_CLUSTER


def pool_of_cluster(cluster: str) -> str | None:
    """The pool whose workers a cluster holds ("" for the default), None for any other."""
    if cluster == WORKER_CLUSTER:
        return ""
    prefix = WORKER_CLUSTER + "-"
    if cluster.startswith(prefix) and POOL_NAME.fullmatch(cluster[len(prefix) :]):
        return cluster[len(prefix) :]
    return None


def pool_names(names: Iterable[str]) -> tuple[str, ...]:
    """Further pools' names, checked: each a DNS label of at most 32 characters, once."""
    checked: list[str] = []
    for name in names:
        if not POOL_NAME.fullmatch(name):
            raise ValueError(
                f"pool name {name!r}: lower-case letters, digits and '-', 1 to 32 characters, "
                "starting and ending with a letter or digit"
            )
        if name in checked:
            raise ValueError(f"pool name {name!r} is named twice")
        checked.append(name)
    return tuple(checked)
