"""A small in-process HTTP server that replays Consul's documented agent and health API.

What it reproduces (https://developer.hashicorp.com/consul/api-docs): every response carries
X-Consul-Index (and X-Consul-KnownLeader); GET /v1/health/service/<name> with ?index=N blocks
until the index exceeds N or ?wait (default 5m, "10s"/"100ms" syntax) elapses, with ?passing
keeping only entries whose checks all pass; each entry is {"Node", "Service", "Checks"} with the
node's serfHealth check; PUT /v1/agent/service/register takes the documented body (keys
matched case-insensitively, as Consul's decoder does), new checks start "critical";
PUT /v1/agent/service/deregister/<id> (404 for an unknown id); GET /v1/agent/services.
Faults: fail_next(n) answers the next n requests 500 ("No cluster leader"); restart() drops
every connection, forgets all state (a -dev agent keeps nothing) and starts again at index 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

NODE = {"ID": "fake-node-id", "Node": "fake-node", "Address": "127.0.0.1", "Datacenter": "dc1"}
SERF_HEALTH = {
    "Node": "fake-node",
    "CheckID": "serfHealth",
    "Name": "Serf Health Status",
    "Status": "passing",
    "ServiceID": "",
    "ServiceName": "",
}
DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")
UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    match = DURATION.match(text)
    if not match:
        raise ValueError(text)
    return float(match.group(1)) * UNITS[match.group(2)]


def lower_keys(value: Any) -> Any:
    """Consul's decoder matches JSON keys case-insensitively; the fake does it by lowering."""
    if isinstance(value, dict):
        return {str(key).lower(): lower_keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [lower_keys(item) for item in value]
    return value


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any
    at: float
    status: int = 0


@dataclass
class Instance:
    service_id: str
    name: str
    address: str
    port: int
    tags: list[str] = field(default_factory=list)
    meta: dict[str, str] = field(default_factory=dict)
    # Status of the instance's own check; None: registered without a check.
    check_status: str | None = "passing"

    def health_entry(self) -> dict[str, Any]:
        checks = [dict(SERF_HEALTH)]
        if self.check_status is not None:
            checks.append(
                {
                    "Node": NODE["Node"],
                    "CheckID": f"service:{self.service_id}",
                    "Name": f"Service '{self.name}' check",
                    "Status": self.check_status,
                    "ServiceID": self.service_id,
                    "ServiceName": self.name,
                }
            )
        return {
            "Node": dict(NODE),
            "Service": {
                "ID": self.service_id,
                "Service": self.name,
                "Tags": self.tags,
                "Meta": self.meta,
                "Address": self.address,
                "Port": self.port,
            },
            "Checks": checks,
        }


class FakeConsul:
    def __init__(self) -> None:
        self.index = 1
        self.instances: dict[str, Instance] = {}
        self.requests: list[Recorded] = []
        self.registrations: list[Any] = []  # raw JSON bodies of every register call
        self.port = 0
        self._failures = 0
        self._changed = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.blocked = 0  # blocking queries being held right now

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> None:
        app = web.Application(middlewares=[self._record])
        app.router.add_put("/v1/agent/service/register", self._register)
        app.router.add_put("/v1/agent/service/deregister/{service_id}", self._deregister)
        app.router.add_get("/v1/agent/services", self._services)
        app.router.add_get("/v1/health/service/{name}", self._health)
        # A short shutdown timeout: held blocking queries are dropped, as a dying agent does.
        self._runner = web.AppRunner(app, shutdown_timeout=0.1, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port or self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def restart(self, downtime: float = 0.3) -> None:
        """Stop (connections refused meanwhile), lose all state, come back on the same port."""
        await self.stop()
        self.instances.clear()
        self.index = 1
        await asyncio.sleep(downtime)
        await self.start(self.port)

    def fail_next(self, count: int) -> None:
        self._failures = count

    # -- state changes (each bumps the index and wakes blocking queries) -------------------

    def bump(self) -> None:
        self.index += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def put_instance(self, instance: Instance) -> None:
        self.instances[instance.service_id] = instance
        self.bump()

    def set_status(self, service_id: str, status: str) -> None:
        self.instances[service_id].check_status = status
        self.bump()

    def remove(self, service_id: str) -> None:
        del self.instances[service_id]
        self.bump()

    def requests_to(self, path_prefix: str) -> list[Recorded]:
        return [r for r in self.requests if r.path.startswith(path_prefix)]

    # -- HTTP -----------------------------------------------------------------------------

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = None
        if request.can_read_body:
            raw = await request.read()
            body = json.loads(raw) if raw else None
        recorded = Recorded(
            request.method,
            request.path,
            dict(request.query),
            dict(request.headers),
            body,
            time.monotonic(),
        )
        self.requests.append(recorded)
        if self._failures > 0:
            self._failures -= 1
            recorded.status = 500
            return web.Response(status=500, text="rpc error: No cluster leader")
        response = await handler(request)
        response.headers["X-Consul-Index"] = str(self.index)
        response.headers["X-Consul-KnownLeader"] = "true"
        response.headers["X-Consul-LastContact"] = "0"
        recorded.status = response.status
        return response

    async def _register(self, request: web.Request) -> web.Response:
        raw = await request.json()  # read() caches the body the middleware already read
        self.registrations.append(raw)
        body = lower_keys(raw)
        checks = body.get("checks") or ([body["check"]] if body.get("check") else [])
        instance = Instance(
            service_id=body.get("id") or body["name"],
            name=body["name"],
            address=body.get("address", ""),
            port=int(body.get("port", 0)),
            tags=list(body.get("tags") or []),
            meta=dict(body.get("meta") or {}),
            check_status=(checks[0].get("status") or "critical") if checks else None,
        )
        self.put_instance(instance)
        return web.Response(status=200)

    async def _deregister(self, request: web.Request) -> web.Response:
        service_id = request.match_info["service_id"]
        if service_id not in self.instances:
            return web.Response(status=404, text=f'Unknown service ID "{service_id}"')
        self.remove(service_id)
        return web.Response(status=200)

    async def _services(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                sid: {
                    "ID": sid,
                    "Service": inst.name,
                    "Tags": inst.tags,
                    "Meta": inst.meta,
                    "Address": inst.address,
                    "Port": inst.port,
                }
                for sid, inst in self.instances.items()
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        index = int(request.query.get("index", "0"))
        if index > 0:
            wait = min(parse_duration(request.query.get("wait", "5m")), 600.0)
            await self._wait_past(index, wait)
        passing = request.query.get("passing") not in (None, "0", "false")
        entries = [
            inst.health_entry()
            for inst in self.instances.values()
            if inst.name == name and (not passing or inst.check_status in ("passing", None))
        ]
        return web.json_response(entries)

    async def _wait_past(self, index: int, wait: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        self.blocked += 1
        try:
            while self.index <= index and (remaining := deadline - loop.time()) > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), remaining)
        finally:
            self.blocked -= 1
