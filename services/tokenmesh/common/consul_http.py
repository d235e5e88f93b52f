"""Consul HTTP API clients (py-consul on aiohttp) from a CONSUL_HTTP_ADDR-style address."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

DEFAULT_PORT = 8500


@dataclass(frozen=True)
class ConsulAddress:
    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, address: str) -> ConsulAddress:
        """ "127.0.0.1:8500", "consul:8500", "http://host:port" or "https://host:port", the
        forms CONSUL_HTTP_ADDR takes (unix sockets are not supported)."""
        text = address.strip()
        parts = urlsplit(text if "://" in text else f"http://{text}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"consul address {address!r}: expected [http[s]://]host[:port]")
        try:
            port = parts.port or DEFAULT_PORT
        except ValueError:
            raise ValueError(f"consul address {address!r}: bad port") from None
        return cls(parts.scheme, parts.hostname, port)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


def consul_client(address: str, request_timeout: float) -> Any:
    """An asyncio Consul client; create it inside the running event loop and close() it.

    request_timeout caps every HTTP request, blocking queries included, so it must exceed their
    wait. An ACL token is taken from CONSUL_HTTP_TOKEN by py-consul itself.
    """
    # Imported here, so services that never talk to Consul do not need py-consul installed.
    try:
        import consul.aio
    except ImportError as exc:
        raise RuntimeError(
            "a Consul address is set but py-consul is not installed "
            "(pip install 'tokenmesh[controlplane]')"
        ) from exc

    parsed = ConsulAddress.parse(address)
    return consul.aio.Consul(
        host=parsed.host,
        port=parsed.port,
        scheme=parsed.scheme,
        # Plain HTTP has no certificate to verify; for https, None lets py-consul read
        # CONSUL_HTTP_SSL_VERIFY (default: verify).
        verify=None if parsed.scheme == "https" else False,
        connections_timeout=request_timeout,
    )


async def put_json(client: Any, path: str, body: Any) -> bool:
    """PUT body as JSON to an agent endpoint with the client's token; True on 200, an
    exception on 4xx/5xx (py-consul's own error mapping)."""
    from consul.callback import CB

    return bool(
        await client.http.put(
            CB.boolean(), path, headers=client.prepare_headers(), data=json.dumps(body)
        )
    )
