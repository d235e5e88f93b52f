"""A client that stops reading pushes back through HTTP/2 flow control: the services stop sending,
Envoy holds only about a window per stream, other clients are not held up, and every token still
arrives, in order, once the client reads again. On the session's shared mesh (2 gateways, 2
workers): what is measured is Envoy's growth and each stream's, which the mesh's size does not
change."""

from __future__ import annotations

import pytest

from tests.harness.slow_consumer import SlowConsumerProbe
from tokenmesh.localmesh.mesh import LocalMesh
from tokenmesh.meshconfig.config import MeshSettings

pytestmark = pytest.mark.integration

STREAMS = 16
# With 20 logprobs per token, a stream of 1900 tokens carries ~650 KB: ten times the window.
MAX_TOKENS = 1900
# The mesh's default stream window; the tiny model's streams overflow it ten times over.
WINDOW = MeshSettings().stream_window_bytes
# Envoy's hops on the direct token path: caller <- edge, and edge <- worker; through the edge's
# stream relay one more, edge <- relay (an internal listener), with what the relay holds.
HOPS = 2


async def test_slow_reader_stops_the_senders_and_bounds_memory(mesh: LocalMesh) -> None:
    # The engine takes ~30 s to make these streams on an idle 2-core machine; a loaded CI
    # machine gets ten times that before the probe gives up.
    result = await SlowConsumerProbe(mesh).run(STREAMS, MAX_TOKENS, limit=300.0)
    print(result)
    # Nothing is lost or truncated: every stream arrives whole once it is read.
    assert result.complete
    # Another client, meanwhile, got its whole stream through the same mesh.
    assert result.bystander_tokens == 64
    # The services that send the tokens (the workers on the direct path, the gateways on theirs)
    # waited on flow control instead of sending everything: what they sent fits in what Envoy
    # and the sockets hold (0.41 of it measured through the relay; all of it would be 1.0).
    assert max(result.worker_sent_fraction, result.gateway_sent_fraction) < 0.75
    # Per stream and hop Envoy holds at most the window it granted upstream plus the buffer
    # towards the slow side, about two windows; three leaves room for framing and headers.
    hops = HOPS + (1 if mesh.settings.mesh().relays else 0)
    assert result.envoy_growth_bytes < STREAMS * hops * 3 * WINDOW < result.output_bytes
