"""The edge's stream relay (stream_relay; envoy/relay): with it, the edge's routes to the workers
send each worker stream to an Envoy internal listener whose only filter is the relay, which
starts the worker's stream itself, keeps what it delivered, and moves the stream to another
worker when its worker goes away. Its listener is listeners.relay_listener.

The relay sits behind a listener of its own because Envoy tells a filter of its caller's flow
control only if it is the last filter of its chain (a terminal filter), and the edge's chain
ends with the router that every other route needs. The edge's router towards the internal
listener keeps the caller's backpressure as on every other hop (decision 0031)."""

from __future__ import annotations

from tokenmesh.common.pools import POOL_HEADER
from tokenmesh.meshconfig.clusters import circuit_breakers
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.constants import TYPE, WORKER, Config
from tokenmesh.meshconfig.policy import Services
from tokenmesh.meshconfig.protocols import grpc_upstream

# The internal listener, and the edge's cluster of it.
RELAY = "worker_relay"
# The module's name: Envoy loads lib<name>.so from ENVOY_DYNAMIC_MODULES_SEARCH_PATH.
MODULE = "tokenmesh_relay"
DYNAMIC_MODULE = TYPE + "envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
INTERNAL_LISTENER = TYPE + "envoy.extensions.bootstrap.internal_listener.v3.InternalListener"


def relay_config(mesh: MeshSettings) -> str:
    """The relay's settings (envoy/relay/README.md): it holds what a stalled caller cannot
    take up to one stream window, as Envoy does per hop, then parks the worker's stream; no
    timeout of its own (the caller's deadline goes to the worker, as on the router's route)."""
    return ";".join(
        [
            f"cluster={WORKER}",
            # A request naming a further pool goes to that pool's cluster (common/pools.py).
            f"pool_header={POOL_HEADER}",
            f"max_resumptions={mesh.max_resumptions}",
            f"max_held_bytes={mesh.stream_window_bytes}",
            f"max_delivered_bytes={mesh.relay_max_delivered_bytes}",
            "timeout_ms=0",
        ]
    )


def bootstrap_extensions(mesh: MeshSettings) -> list[Config]:
    """Envoy's internal listeners, which the relay's listener is."""
    if not mesh.relays:
        return []
    return [
        {
            "name": "envoy.bootstrap.internal_listener",
            "typed_config": {"@type": INTERNAL_LISTENER},
        }
    ]


def relay_filter(mesh: MeshSettings) -> Config:
    """The relay, the last and only filter of its listener (listeners.relay_listener)."""
    return {
        "name": "tokenmesh.stream_relay",
        "typed_config": {
            "@type": DYNAMIC_MODULE,
            "dynamic_module_config": {"name": MODULE},
            "filter_name": "relay",
            "terminal_filter": True,
            "filter_config": {
                "@type": TYPE + "google.protobuf.StringValue",
                "value": relay_config(mesh),
            },
        },
    }


def relay_cluster(mesh: MeshSettings, services: Services) -> list[Config]:
    """The edge's way to the relay: the internal listener, over HTTP/2 with the mesh's windows
    (the caller's backpressure reaches the relay through them), bounded as the workers are."""
    if not mesh.relays:
        return []
    return [
        {
            "name": RELAY,
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {
                "cluster_name": RELAY,
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "envoy_internal_address": {"server_listener_name": RELAY}
                                    }
                                }
                            }
                        ]
                    }
                ],
            },
            "typed_extension_protocol_options": grpc_upstream(mesh),
            "circuit_breakers": circuit_breakers(services.worker.circuit_breaker),
        }
    ]


def relayed(route: Config, mesh: MeshSettings) -> Config:
    """A route to the workers, sent through the relay with stream_relay: the relay retries a
    stream its worker failed before answering, and moves one it failed later, itself."""
    if not mesh.relays:
        return route
    action = {
        key: value
        for key, value in route["route"].items()
        if key not in ("cluster", "retry_policy")
    }
    return {**route, "route": {**action, "cluster": RELAY}}
