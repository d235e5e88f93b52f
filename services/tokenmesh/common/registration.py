"""Self-registration in Consul: register on start, stay registered, deregister on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenmesh.common.consul_http import ConsulAddress, consul_client, put_json
from tokenmesh.common.settings import ServiceSettings

log = logging.getLogger(__name__)

# Consul runs the gRPC health check (grpc.health.v1 Check of the whole server, service "")
# this often, and fails it after this long without an answer.
CHECK_INTERVAL = "5s"
CHECK_TIMEOUT = "2s"
# An instance whose check stays critical this long is removed from the catalog, so a crashed
# process that never deregistered does not linger.
DEREGISTER_CRITICAL_AFTER = "1m"
# How often the registration is verified (and re-created if Consul lost it, e.g. a dev agent
# or a wiped data directory after a restart).
RESYNC_SECONDS = 3.0
# Every request to the agent; shutdown waits at most this long to deregister.
REQUEST_TIMEOUT_SECONDS = 3.0


@dataclass(frozen=True)
class ServiceInstance:
    """One running instance as Consul should know it."""

    name: str
    address: str
    port: int
    tags: tuple[str, ...] = ()
    meta: Mapping[str, str] = field(default_factory=dict)
    check_interval: str = CHECK_INTERVAL
    check_timeout: str = CHECK_TIMEOUT
    deregister_critical_after: str = DEREGISTER_CRITICAL_AFTER

    @property
    def service_id(self) -> str:
        """Unique per agent: name-host-port."""
        return f"{self.name}-{self.address}-{self.port}"

    def check(self) -> dict[str, Any]:
        """A native Consul gRPC health check against the instance's own grpc.health.v1."""
        return {
            "Name": f"{self.name} gRPC health",
            "GRPC": f"{self.address}:{self.port}",
            # Plaintext: TLS is Envoy's job in this mesh.
            "GRPCUseTLS": False,
            "Interval": self.check_interval,
            "Timeout": self.check_timeout,
            "DeregisterCriticalServiceAfter": self.deregister_critical_after,
        }


def advertised_host(settings: ServiceSettings) -> str:
    """The IP others reach this service at: advertise_host if set, else host, unless host is a
    wildcard (0.0.0.0, ::), then this machine's hostname resolved (the usual container IP)."""
    if settings.advertise_host:
        return settings.advertise_host
    try:
        wildcard = ipaddress.ip_address(settings.host).is_unspecified
    except ValueError:
        wildcard = not settings.host
    return socket.gethostbyname(socket.gethostname()) if wildcard else settings.host


def instance_for(
    settings: ServiceSettings,
    role: str,
    port: int,
    metrics_port: int = -1,
    extra: Mapping[str, str] | None = None,
    name: str | None = None,
) -> ServiceInstance:
    """The instance of a tokenmesh service: named after its Envoy cluster (name; its role by
    default), tagged role=<role> plus extra (e.g. model=<model> for workers), the same in
    meta."""
    meta = {"role": role, **(extra or {})}
    if metrics_port >= 0:
        meta["metrics_port"] = str(metrics_port)
    tags = tuple(f"{key}={value}" for key, value in meta.items() if key != "metrics_port")
    # Only resolved when it will be registered: a service without Consul never looks it up.
    address = advertised_host(settings) if settings.consul_http_addr else settings.host
    return ServiceInstance(name=name or role, address=address, port=port, tags=tags, meta=meta)


class ConsulRegistration:
    """Keeps one instance registered with the local Consul agent while the service runs.

    start() returns at once: registration happens in the background and is retried, so a
    missing Consul never delays or fails a service. Every RESYNC_SECONDS the agent is asked
    whether it still has the instance and it is registered again if not. stop() deregisters.
    With no Consul address every method is a no-op.
    """

    def __init__(
        self,
        consul_http_addr: str | None,
        instance: ServiceInstance,
        resync_seconds: float = RESYNC_SECONDS,
        request_timeout: float = REQUEST_TIMEOUT_SECONDS,
    ) -> None:
        if consul_http_addr is not None:
            ConsulAddress.parse(consul_http_addr)  # a typo fails at start-up, not later
        self._address = consul_http_addr
        self.instance = instance
        self._resync_seconds = resync_seconds
        self._request_timeout = request_timeout
        self._client: Any = None
        self._task: asyncio.Task[None] | None = None
        # Set whenever the instance is known to be registered (for tests and logs).
        self.registered = asyncio.Event()

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def payload(self) -> dict[str, Any]:
        """The agent's /v1/agent/service/register body this registration sends."""
        instance = self.instance
        return {
            "Name": instance.name,
            "ID": instance.service_id,
            "Address": instance.address,
            "Port": instance.port,
            "Tags": list(instance.tags),
            "Meta": dict(instance.meta),
            "Check": instance.check(),
        }

    def start(self) -> None:
        if self._address is None or self._task is not None:
            return
        self._client = consul_client(self._address, self._request_timeout)
        self._task = asyncio.create_task(self._keep_registered(), name="consul-registration")

    async def stop(self) -> None:
        """Stop re-registering and deregister (best effort, bounded by the request timeout)."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        service_id = self.instance.service_id
        try:
            await asyncio.wait_for(
                self._client.agent.service.deregister(service_id), self._request_timeout
            )
            log.info("deregistered from consul", extra={"service_id": service_id})
        except Exception as exc:
            # The check's DeregisterCriticalServiceAfter removes it eventually.
            log.warning(
                "could not deregister from consul",
                extra={"service_id": service_id, "error": repr(exc)},
            )
        self.registered.clear()
        await self._client.close()

    async def _register(self) -> None:
        # The documented body as is (py-consul's agent.service.register rewrites the keys).
        await put_json(self._client, "/v1/agent/service/register", self.payload())

    async def _is_registered(self) -> bool:
        # The agent's own list (not the catalog): it is what a restarted agent forgets.
        services = await self._client.agent.services()
        return self.instance.service_id in (services or {})

    async def _keep_registered(self) -> None:
        service_id = self.instance.service_id
        failing = False
        while True:
            try:
                if not self.registered.is_set() or not await self._is_registered():
                    if self.registered.is_set():
                        log.warning(
                            "consul lost the registration", extra={"service_id": service_id}
                        )
                    self.registered.clear()
                    await self._register()
                    self.registered.set()
                    log.info(
                        "registered in consul",
                        extra={"service_id": service_id, "consul": self._address},
                    )
                failing = False
            except Exception as exc:
                # Retried at the next resync; logged once per outage, not every few seconds.
                if not failing:
                    log.warning(
                        "consul registration failed; retrying",
                        extra={"service_id": service_id, "error": repr(exc)},
                    )
                failing = True
            await asyncio.sleep(self._resync_seconds)
