"""Client channels to other services: options from the production playbook and connect checks."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
from grpc import aio

from tokenmesh.common.errors import DependencyError, Unavailable

# Status codes that say the caller's request itself was wrong: passed on unchanged.
CALLER_FAULTS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)

# What gRPC reports when the peer, or Envoy in front of it, resets a stream or the connection
# breaks: the code is INTERNAL or UNKNOWN although nothing in the service failed (the process
# died, was killed, or the network went away). Callers see UNAVAILABLE for these.
TRANSPORT_RESETS = ("RST_STREAM", "Stream removed", "Socket closed", "Connection reset")


def transport_reset(err: aio.AioRpcError) -> bool:
    """err is a broken stream or connection, not an error the service answered with."""
    if err.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        return False
    details = err.details() or ""
    return any(marker in details for marker in TRANSPORT_RESETS)


def client_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Ping every 5 s and give up after 10 s without an answer: a dead peer (or a silently
        # dropped connection) is noticed in seconds, not at the TCP timeout. Not 1 s: a peer
        # starved of CPU (a throttled pod, a busy 2-core machine) can take that long to answer,
        # and a live connection was cut with every stream on it (measured).
        ("grpc.keepalive_time_ms", 5_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Keep pinging idle connections too, so the first request after a lull finds them live.
        ("grpc.keepalive_permit_without_calls", 1),
        # Reconnect quickly after a dependency restarts (the default backoff reaches 120 s).
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        # HTTP/2 windows stay gRPC's adaptive defaults on purpose: gRPC returns connection
        # window only as the application reads, so fixed small stream windows let a few slow
        # callers' unread streams use up the shared connection's window and stall every other
        # stream on it (measured: a bystander's stream hung behind 16 unread ones).
    ]


class Dependency:
    """A named channel to another service (or to the Envoy listener in front of it)."""

    def __init__(
        self,
        name: str,
        address: str,
        max_message_bytes: int,
        interceptors: Sequence[aio.ClientInterceptor] = (),
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """credentials: TLS towards address (None: plaintext)."""
        self.name = name
        self.address = address
        options = client_options(max_message_bytes)
        self.channel = (
            aio.insecure_channel(address, options=options, interceptors=list(interceptors))
            if credentials is None
            else aio.secure_channel(
                address, credentials, options=options, interceptors=list(interceptors)
            )
        )

    async def ensure_connected(self, within: float) -> None:
        """Wait up to `within` seconds for a connection; else UNAVAILABLE naming the dependency."""
        if self.channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY:
            return
        try:
            await asyncio.wait_for(self.channel.channel_ready(), within)
        except TimeoutError:
            raise Unavailable(
                f"{self.name}: cannot connect to {self.address} within {within:g}s"
            ) from None

    def error(self, err: aio.AioRpcError, during: str = "") -> DependencyError:
        """The error the caller sees when a call to this dependency failed with err; `during`
        says how far the call had got (e.g. "after 12 tokens")."""
        details = err.details() or err.code().name
        if err.code() in CALLER_FAULTS:
            return DependencyError(err.code(), details)
        where = f" {during}" if during else ""
        if transport_reset(err):
            return DependencyError(
                grpc.StatusCode.UNAVAILABLE,
                f"{self.name}: the stream was cut{where} (the {self.name} went away): {details}",
            )
        return DependencyError(err.code(), f"{self.name}{where}: {details}")

    async def close(self) -> None:
        await self.channel.close()
