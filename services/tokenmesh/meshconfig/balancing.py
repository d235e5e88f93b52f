"""How the workers' cluster picks a worker for a stream, as Envoy's typed load-balancing policy,
one for each worker_routing setting. The policy belongs to the cluster, not to a route: the
edge's router, the gateways' internal listener and the edge's stream relay (whose worker
streams carry no route) all pick a worker the same way, from the request's headers."""

from __future__ import annotations

from tokenmesh.common.tokens import AFFINITY_HEADER, WORKER_HEADER
from tokenmesh.meshconfig.constants import TYPE, Config

POLICIES = TYPE + "envoy.extensions.load_balancing_policies."
ROUTINGS = ("least_request", "prefix", "picker")


def _policy(name: str, typed: str, **config: object) -> Config:
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": f"envoy.load_balancing_policies.{name}",
                    "typed_config": {"@type": POLICIES + typed, **config},
                }
            }
        ]
    }


def least_request() -> Config:
    """Least outstanding requests, per stream (of two drawn at random): long and short
    generations even out."""
    return _policy("least_request", "least_request.v3.LeastRequest")


def prefix(balance_factor: int | str) -> Config:
    """Maglev on the gateway's prefix-affinity key, under bounded load: no worker takes more
    than balance_factor % of the mean streams in flight; a key whose worker is over it goes to
    the next in the table. Maglev rather than a ring hash: one table look-up per pick, and an
    even spread of keys over a few hosts; both move only a departed host's keys elsewhere. The
    hash is the cluster's (Envoy then ignores a route's), so a stream the relay starts is
    placed by the same key; a retry hashes again, past the hosts already tried."""
    return _policy(
        "maglev",
        "maglev.v3.Maglev",
        consistent_hashing_lb_config={
            "hash_balance_factor": balance_factor,
            "hash_policy": [{"header": {"header_name": AFFINITY_HEADER}}],
        },
    )


def picker() -> Config:
    """Each attempt goes to the next worker the gateway's endpoint picker named
    (WORKER_HEADER); with none named, or all tried, least request."""
    return _policy(
        "override_host",
        "override_host.v3.OverrideHost",
        override_host_sources=[{"header": WORKER_HEADER}],
        fallback_policy=least_request(),
    )


def worker_balancing(routing: str, balance_factor: int | str) -> Config:
    """The workers' load_balancing_policy for a worker_routing setting."""
    if routing == "prefix":
        return prefix(balance_factor)
    if routing == "picker":
        return picker()
    if routing == "least_request":
        return least_request()
    raise ValueError(f"worker_routing {routing!r} is none of {', '.join(ROUTINGS)}")
