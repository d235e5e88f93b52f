"""Client channels to other services: options from the production playbook and connect checks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc import aio

from tokenmesh.common.credentials import ReloadingChannelCredentials
from tokenmesh.common.errors import DependencyError, Unavailable

log = logging.getLogger(__name__)

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


class _Route:
    """A stub's method on a SwappableChannel: each call goes to the channel current then."""

    def __init__(self, owner: SwappableChannel, kind: str, args: Any, kwargs: Any) -> None:
        self._owner = owner
        self._kind = kind
        self._args = args
        self._kwargs = kwargs
        self._made: tuple[aio.Channel, Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        channel = self._owner.current
        if self._made is None or self._made[0] is not channel:
            method = getattr(channel, self._kind)(*self._args, **self._kwargs)
            self._made = (channel, method)
        return self._made[1](*args, **kwargs)


class SwappableChannel:
    """A channel that stubs are built on once and that can be replaced under them: after
    swap(), new calls go to the new channel while calls in flight finish on the old one,
    which closes when they are done (at most `grace` seconds later). For TLS files renewed
    in place, since gRPC has no channel credentials that reload."""

    def __init__(self, open_channel: Callable[[], aio.Channel]) -> None:
        self._open = open_channel
        self.current = open_channel()
        # Replaced channels, each closing once its calls are done.
        self._old: dict[asyncio.Task[None], aio.Channel] = {}

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _Route(self, "unary_unary", args, kwargs)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _Route(self, "unary_stream", args, kwargs)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _Route(self, "stream_unary", args, kwargs)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _Route(self, "stream_stream", args, kwargs)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current.get_state(try_to_connect)

    async def channel_ready(self) -> None:
        await self.current.channel_ready()

    def swap(self, grace: float) -> None:
        old, self.current = self.current, self._open()
        task = asyncio.get_running_loop().create_task(old.close(grace), name="old-channel")
        self._old[task] = old
        task.add_done_callback(lambda done: self._old.pop(done, None))

    @property
    def retiring(self) -> int:
        """Replaced channels not closed yet (calls still in flight on them)."""
        return len(self._old)

    async def close(self, grace: float | None = None) -> None:
        """Close the current channel, and wait a little for replaced ones: their calls usually
        end at once at shutdown, when the callers (RPC handlers) are cancelled."""
        await self.current.close(grace)
        if self._old:
            await asyncio.wait(list(self._old), timeout=grace if grace is not None else 1.0)


class Dependency:
    """A named channel to another service (or to the Envoy listener in front of it)."""

    # How often watch_tls() looks at the TLS files (a stat each), and how long calls that
    # were in flight on a channel opened with the previous files may go on.
    TLS_CHECK_SECONDS = 5.0
    OLD_CHANNEL_GRACE_SECONDS = 600.0

    def __init__(
        self,
        name: str,
        address: str,
        max_message_bytes: int,
        interceptors: Sequence[aio.ClientInterceptor] = (),
        tls: ReloadingChannelCredentials | None = None,
    ) -> None:
        """tls: TLS towards address, from files (None: plaintext)."""
        self.name = name
        self.address = address
        self._tls = tls
        options = client_options(max_message_bytes)

        def open_channel() -> aio.Channel:
            if tls is None:
                return aio.insecure_channel(
                    address, options=options, interceptors=list(interceptors)
                )
            return aio.secure_channel(
                address, tls.credentials(), options=options, interceptors=list(interceptors)
            )

        self.channel = SwappableChannel(open_channel)

    async def watch_tls(
        self,
        every: float = TLS_CHECK_SECONDS,
        grace: float = OLD_CHANNEL_GRACE_SECONDS,
    ) -> None:
        """reload_tls() every `every` seconds until cancelled; returns at once without TLS."""
        if self._tls is None:
            return
        while True:
            await asyncio.sleep(every)
            self.reload_tls(grace)

    def reload_tls(self, grace: float = OLD_CHANNEL_GRACE_SECONDS) -> bool:
        """Open a new channel if the TLS files changed (a renewed CA or client certificate);
        calls in flight on the old one get `grace` seconds. True when it did."""
        if self._tls is None or not self._tls.changed():
            return False
        log.info(
            "TLS files changed: new channel",
            extra={"dependency": self.name, "files": [str(p) for p in self._tls.paths]},
        )
        self.channel.swap(grace)
        return True

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
