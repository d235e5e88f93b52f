"""The edge's stream relay (envoy/relay/tokenmesh_relay.c), built with gcc and loaded into a
real Envoy as a dynamic module, in front of stand-in workers (tests/relay_fake_worker.py, which
read a moved stream's delivered messages with the worker's own code): a worker killed
mid-stream, and the stream goes on at the other worker from the token where it stopped; past
the limit it ends UNAVAILABLE saying how far it got; a worker's own error reaches the caller as
it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tests.support import ENVOY, ROOT, fetch_text, relay_metric, require_c_compiler
from tokenmesh.common.processes import stop_process
from tokenmesh.localmesh.probes import free_port, http_ok
from tokenmesh.localmesh.relay_module import RELAY_SOURCE, SEARCH_PATH, build_relay_module
from tokenmesh.meshconfig.access_logs import relay_access_log
from tokenmesh.meshconfig.protocols import HTTP_OPTIONS, names_host
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2

SOURCE = ROOT / RELAY_SOURCE
FAKE_WORKER = ROOT / "tests" / "relay_fake_worker.py"
TYPE = "type.googleapis.com/"
HCM = TYPE + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
DYNAMIC_MODULE = TYPE + "envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
STRING = TYPE + "google.protobuf.StringValue"
HEADER_MUTATION = TYPE + "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
EARLY_HEADER_MUTATION = (
    TYPE + "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"
)
TOKENS = 40
DIE_AFTER = 15
WINDOW = 65536


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_c_compiler()
    return build_relay_module(SOURCE, tmp_path_factory.mktemp("relay")).parent


@dataclass
class Relay:
    port: int
    admin: int
    records: list[Path]
    workers: list[int]  # the stand-in workers' ports
    access_log: Path

    def logged(self, seconds: float = 10) -> dict[str, object]:
        """The access log's line of the one stream, once Envoy has written it."""
        deadline = time.monotonic() + seconds
        while not (self.access_log.exists() and self.access_log.read_text().strip()):
            assert time.monotonic() < deadline, "no access-log line"
            time.sleep(0.1)
        (line,) = self.access_log.read_text().splitlines()
        return dict(json.loads(line))

    def metric(self, name: str, **labels: str) -> float:
        """One of the relay's own metrics as Prometheus scrapes it from Envoy (0 if absent)."""
        return relay_metric(self.admin, name, **labels)

    def metric_within(self, name: str, value: float, seconds: float = 15) -> float:
        """The metric once it reaches value (Envoy publishes histograms at its stats flush),
        or as it is after `seconds`."""
        deadline = time.monotonic() + seconds
        while (found := self.metric(name)) < value and time.monotonic() < deadline:
            time.sleep(0.2)
        return found

    def requests(self, worker: int) -> list[dict[str, object]]:
        """What each request the worker received had delivered, and its move's attempt."""
        path = self.records[worker]
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines]


def header_mutation(name: str, mutations: dict[str, object]) -> dict[str, object]:
    return {"name": name, "typed_config": {"@type": HEADER_MUTATION, "mutations": mutations}}


def envoy_config(
    port: int,
    admin: int,
    workers: list[int],
    relay_config: str,
    log: Path,
    grpc_timeout: str | None = None,
) -> dict[str, object]:
    """A listener whose only filter is the relay, logging as the mesh's relay listener does
    (to log), over a worker cluster that names the worker that answered, as the mesh's does,
    and whose first worker has priority (the second takes streams once the first is ejected:
    the mesh's outlier rule, a worker out at its first failed connection). With grpc_timeout
    the relay sees that deadline instead of the caller's, and the workers none: the relay's
    own deadline is then the only one that can pass."""
    names = names_host()
    early: list[dict[str, object]] = []
    if grpc_timeout is not None:
        header = {"key": "grpc-timeout", "value": grpc_timeout}
        early = [
            {
                "name": "deadline",
                "typed_config": {
                    "@type": EARLY_HEADER_MUTATION,
                    "mutations": [
                        {
                            "append": {
                                "header": header,
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                            }
                        }
                    ],
                },
            }
        ]
        names = [
            header_mutation("no_deadline", {"request_mutations": [{"remove": "grpc-timeout"}]}),
            *names,
        ]
    http2 = {
        HTTP_OPTIONS: {
            "@type": TYPE + HTTP_OPTIONS,
            "explicit_http_config": {"http2_protocol_options": {}},
            "http_filters": names,
        }
    }
    (access_log,) = relay_access_log("relay")
    access_log["name"] = "envoy.access_loggers.file"
    access_log["typed_config"] = {
        "@type": TYPE + "envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": str(log),
        "log_format": access_log["typed_config"]["log_format"],
    }
    endpoint = lambda worker: {  # noqa: E731
        "endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": worker}}}
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        # Histograms reach the admin page at each stats flush.
        "stats_flush_interval": "0.5s",
        "static_resources": {
            "listeners": [
                {
                    "name": "edge",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": HCM,
                                        "stat_prefix": "edge",
                                        "codec_type": "AUTO",
                                        "early_header_mutation_extensions": early,
                                        "access_log": [access_log],
                                        # The mesh's windows (stream_window_bytes). Envoy's
                                        # HTTP/2 codec holds up to a stream window of what the
                                        # caller has not taken before it tells the filters.
                                        "http2_protocol_options": {
                                            "initial_stream_window_size": WINDOW,
                                            "initial_connection_window_size": WINDOW,
                                        },
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "name": "all",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "match": {"prefix": "/"},
                                                            "route": {
                                                                "cluster": "worker",
                                                                "timeout": "0s",
                                                            },
                                                        }
                                                    ],
                                                }
                                            ]
                                        },
                                        "http_filters": [
                                            {
                                                "name": "envoy.filters.http.dynamic_modules",
                                                "typed_config": {
                                                    "@type": DYNAMIC_MODULE,
                                                    "dynamic_module_config": {
                                                        "name": "tokenmesh_relay",
                                                        "do_not_close": True,
                                                    },
                                                    "filter_name": "relay",
                                                    "terminal_filter": True,
                                                    "filter_config": {
                                                        "@type": STRING,
                                                        "value": relay_config,
                                                    },
                                                },
                                            }
                                        ],
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "worker",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": http2,
                    "outlier_detection": {
                        "split_external_local_origin_errors": True,
                        "consecutive_local_origin_failure": 1,
                        "enforcing_consecutive_local_origin_failure": 100,
                        "base_ejection_time": "60s",
                        "max_ejection_percent": 100,
                    },
                    "load_assignment": {
                        "cluster_name": "worker",
                        "endpoints": [
                            {"priority": i, "lb_endpoints": [endpoint(w)]}
                            for i, w in enumerate(workers)
                        ],
                    },
                }
            ],
        },
    }


@pytest.fixture
def relay(request: pytest.FixtureRequest, module_dir: Path, tmp_path: Path) -> Iterator[Relay]:
    """Two stand-in workers (the first dies after its DIE_AFTER-th message) behind an Envoy
    with the relay; the test's parameter, if any, is the relay's config and when the first
    worker dies (0: never)."""
    relay_config, die_after, *deadline = getattr(request, "param", ("cluster=worker", DIE_AFTER))
    ports = [free_port() for _ in range(2)]
    records = [tmp_path / f"worker-{i}.jsonl" for i in range(2)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'services'}:{ROOT}"}
    workers = []
    for i, port in enumerate(ports):
        die = {"DIE_AFTER": str(die_after)} if i == 0 and die_after else {}
        workers.append(
            subprocess.Popen(
                [sys.executable, str(FAKE_WORKER), str(port), str(records[i])],
                env={**env, **die},
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    for worker in workers:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "serving"
    edge, admin = free_port(), free_port()
    config = tmp_path / "envoy.json"
    log_path = tmp_path / "access.log"
    config.write_text(
        json.dumps(envoy_config(edge, admin, ports, relay_config, log_path, *deadline))
    )
    log = (tmp_path / "envoy.log").open("w")
    envoy = subprocess.Popen(
        [ENVOY or "envoy", "-c", str(config), "--base-id", str(edge), "-l", "warning"],
        env={**os.environ, SEARCH_PATH: str(module_dir)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while not http_ok(f"http://127.0.0.1:{admin}/ready"):
            assert envoy.poll() is None, (tmp_path / "envoy.log").read_text()
            assert time.monotonic() < deadline, "Envoy not ready in 30 s"
            time.sleep(0.1)
        yield Relay(edge, admin, records, ports, log_path)
    finally:
        stop_process(envoy, 10)
        log.close()
        for worker in workers:
            stop_process(worker, 10)


# The workers a gateway named for the stream, best first.
NAMED = "127.0.0.1:1001,127.0.0.1:1002"


def generate(
    relay: Relay, max_tokens: int = TOKENS
) -> tuple[list[token_pb2.Token], grpc.RpcError | None]:
    """A Generate through the relay: the messages it got, and the error it ended with."""
    with grpc.insecure_channel(f"127.0.0.1:{relay.port}") as channel:
        call = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
            inference_pb2.InferenceRequest(
                prompt="p", sampling=inference_pb2.SamplingParams(max_tokens=max_tokens)
            ),
            timeout=30,
            metadata=[("x-tokenmesh-worker", NAMED)],
        )
        tokens: list[token_pb2.Token] = []
        try:
            for token in call:
                tokens.append(token)
        except grpc.RpcError as error:
            return tokens, error
        return tokens, None


def test_a_worker_killed_mid_stream_the_stream_goes_on_at_the_other(relay: Relay) -> None:
    tokens, error = generate(relay)
    assert error is None, error
    assert [t.index for t in tokens] == list(range(TOKENS))
    assert [t.token_id for t in tokens] == [1000 + i for i in range(TOKENS)]
    assert tokens[-1].finish_reason == token_pb2.FINISH_REASON_LENGTH
    assert [t.index for t in tokens if t.resumed] == [DIE_AFTER]
    assert tokens[DIE_AFTER].resumed == 1
    # The other worker got the request with what had been delivered, as the relay's bytes.
    assert [r for r in relay.requests(1) if "delivered" in r] == [
        {"delivered": [[1000 + i for i in range(DIE_AFTER)]], "attempt": 1}
    ]
    # Within what was left of the caller's deadline (30 s), not the whole of it again.
    first, moved = [r for w in (0, 1) for r in relay.requests(w) if "remaining_s" in r]
    assert 0 < moved["remaining_s"] < first["remaining_s"] <= 30, (first, moved)
    # The worker that failed leaves the gateway's named workers (Envoy's override-host policy
    # takes the first): the next one is asked for, and with none left the cluster picks (an
    # attempt refused by the dead worker before its ejection took the second out too).
    assert first["named"] == NAMED
    assert moved["named"] in ("127.0.0.1:1002", None)
    # Counted by cause, with the gap the caller saw.
    assert relay.metric("resumptions", cause="stream_reset") == 1
    assert relay.metric_within("resumption_gap_ms_count", 1) == 1
    assert relay.metric("parks") == 0
    # The access log names the worker the stream ended on (its cluster's answer header, not
    # the caller's view), and its move.
    logged = relay.logged()
    assert logged["upstream_host"] == f"127.0.0.1:{relay.workers[1]}", logged
    assert (logged["upstream_cluster"], logged["moves"], logged["parks"]) == ("worker", 1, 0)


@pytest.mark.parametrize(
    ("relay", "why", "reason"),
    [
        (("cluster=worker;max_resumptions=0", DIE_AFTER), "moved 0 times already", "limit"),
        # 15 messages of ~20 bytes are more than the relay may keep: it kept none.
        (
            ("cluster=worker;max_delivered_bytes=100", DIE_AFTER),
            "max_delivered_bytes (100)",
            "unkept",
        ),
    ],
    indirect=["relay"],
)
def test_past_the_limit_the_stream_ends_unavailable_saying_how_far_it_got(
    relay: Relay, why: str, reason: str
) -> None:
    tokens, error = generate(relay)
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert f"after {DIE_AFTER} messages" in (error.details() or ""), error.details()
    assert why in (error.details() or ""), error.details()
    assert relay.metric("resumptions_refused", reason=reason) == 1
    assert relay.metric("resumptions", cause="stream_reset") == 0
    assert [t.index for t in tokens] == list(range(DIE_AFTER))
    assert relay.requests(1) == []


# The relay's deadline (50 ms) passes before the first worker dies (15 messages 10 ms apart).
@pytest.mark.parametrize("relay", [("cluster=worker", DIE_AFTER, "50m")], indirect=True)
def test_a_stream_whose_worker_goes_away_past_its_deadline_ends_deadline_exceeded(
    relay: Relay,
) -> None:
    tokens, error = generate(relay)
    assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
    assert "deadline passed before the stream could go on" in (error.details() or "")
    assert [t.index for t in tokens] == list(range(DIE_AFTER))
    assert relay.metric("resumptions_refused", reason="deadline") == 1
    assert relay.requests(1) == []


def test_a_caller_that_goes_away_ends_the_workers_stream(relay: Relay) -> None:
    """Its engine request is aborted: the stand-in worker sees its stream cancelled."""
    with grpc.insecure_channel(f"127.0.0.1:{relay.port}") as channel:
        call = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
            inference_pb2.InferenceRequest(
                prompt="p", sampling=inference_pb2.SamplingParams(max_tokens=TOKENS)
            ),
            timeout=30,
        )
        assert next(call).index == 0
        call.cancel()
    deadline = time.monotonic() + 10
    while not any(r.get("ended") == "cancelled" for r in relay.requests(0)):
        assert time.monotonic() < deadline, relay.requests(0)
        time.sleep(0.05)


# A caller's stream of ~400 KB: past its own window (64 KiB), the window Envoy keeps towards it
# (64 KiB, after which the filter hears of it) and what the relay may hold (16 KiB).
PARKED_TOKENS = 100


def read_after_a_stall(
    relay: Relay, prompt: str, max_tokens: int, stalled: Callable[[], bool]
) -> list[int]:
    """A caller that reads one message, then nothing until `stalled` holds (within 20 s),
    then the rest (its window stays at 64 KiB: no BDP probing to grow it): it gets the whole
    stream, in order, which went on from what had been delivered each time it was parked (a
    burst may outrun the caller again); how many tokens had been, each time."""
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", WINDOW)]
    with grpc.insecure_channel(f"127.0.0.1:{relay.port}", options=options) as channel:
        call = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
            inference_pb2.InferenceRequest(
                prompt=prompt, sampling=inference_pb2.SamplingParams(max_tokens=max_tokens)
            ),
            timeout=60,
        )
        tokens = [next(call)]
        deadline = time.monotonic() + 20
        while not stalled():
            assert time.monotonic() < deadline, relay.requests(0)
            time.sleep(0.05)
        tokens.extend(call)
    assert [t.index for t in tokens] == list(range(max_tokens))
    assert [t.token_id for t in tokens] == [1000 + i for i in range(max_tokens)]
    first, *again = [r for r in relay.requests(0) if "delivered" in r]
    assert first == {"delivered": [], "attempt": 0}
    assert again, "the stream was never parked"
    counts = [len(r["delivered"][0]) for r in again]  # type: ignore[index]
    for request, count in zip(again, counts, strict=True):
        assert request["delivered"] == [[1000 + i for i in range(count)]]
    assert counts[0] > 0 and counts == sorted(counts) and counts[-1] < max_tokens
    assert relay.metric("parks") == len(counts)
    return counts


# A park is not a move (the worker was not at fault): it is made with no moves allowed.
PARKING = "cluster=worker;max_resumptions=0;max_held_bytes=16384"


@pytest.mark.parametrize("relay", [(PARKING, 0)], indirect=True)
def test_a_caller_that_stops_reading_parks_the_worker_and_gets_the_rest_once_it_reads(
    relay: Relay,
) -> None:
    """Messages of ~4 KB to a caller that reads one and stops: once the relay holds more than
    max_held_bytes, the worker's stream is cancelled (its engine request aborted); once the
    caller reads again, the stream goes on from what was delivered, whole and in order."""
    parks = read_after_a_stall(
        relay,
        "pad:4000",
        PARKED_TOKENS,
        lambda: any(r.get("ended") == "cancelled" for r in relay.requests(0)),
    )
    assert relay.metric("resumptions", cause="stream_reset") == 0
    logged = relay.logged()
    assert (logged["upstream_host"], logged["moves"], logged["parks"]) == (
        f"127.0.0.1:{relay.workers[0]}",
        0,
        len(parks),
    )


# A stream of 20 messages of ~16 kB that its worker sends as fast as it can.
BURST_TOKENS = 20


@pytest.mark.parametrize("relay", [(PARKING, 0)], indirect=True)
def test_what_a_stalled_caller_cannot_take_is_dropped_and_made_again_not_held(
    relay: Relay,
) -> None:
    """A worker that sends its whole stream at once to a caller that reads one message and
    stops: past max_held_bytes the relay neither delivers nor holds the worker's messages (a
    stalled caller costs it at most max_held_bytes); once the caller reads, the stream goes on
    from what was delivered and a worker makes the dropped ones again, whole and in order."""
    read_after_a_stall(relay, "burst:16000", BURST_TOKENS, lambda: relay.metric("parks") >= 1)


# Up to 150 kB held: more than the 20 first messages leave once the windows are full.
HOLDING = "cluster=worker;max_resumptions=0;max_held_bytes=150000"


@pytest.mark.parametrize("relay", [(HOLDING, 0)], indirect=True)
def test_a_stream_whose_last_message_came_is_held_not_parked(relay: Relay) -> None:
    """A caller that has not read when the worker's last message (the usage's) comes, the
    worker's trailers still to follow: the relay holds it instead of cancelling the worker (the
    engine is done; continued with nothing left to generate, the stream would be refused), and
    the caller gets the whole stream and OK once it reads."""
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", WINDOW)]
    with grpc.insecure_channel(f"127.0.0.1:{relay.port}", options=options) as channel:
        call = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
            # 20 messages of 8 kB fill the windows (64 KiB the caller's, as much in Envoy's
            # codec) and leave less than max_held_bytes held; the last, of 300 kB, is held
            # past it.
            inference_pb2.InferenceRequest(
                prompt="last:8000:300000", sampling=inference_pb2.SamplingParams(max_tokens=21)
            ),
            timeout=30,
        )
        # Nothing read until the worker has sent its last message (its trailers linger).
        time.sleep(1.5)
        tokens = list(call)
        assert call.code() == grpc.StatusCode.OK, call.details()
    assert [t.index for t in tokens] == list(range(21))
    assert tokens[-1].usage.completion_tokens == 21
    assert [r for r in relay.requests(0) if "delivered" in r] == [{"delivered": [], "attempt": 0}]
    assert relay.metric("parks") == 0


# 16 streams of messages of ~1 KB, each stalled after its first: a window waits in Envoy's
# codec and up to a window is held by the relay, per stream.
STALLED = 16
KB_MESSAGES = "pad:1000"


@pytest.mark.parametrize("relay", [(f"cluster=worker;max_held_bytes={WINDOW}", 0)], indirect=True)
def test_a_stalled_callers_window_costs_envoy_its_bytes_not_a_page_a_message(
    relay: Relay,
) -> None:
    """Callers that stop reading streams of ~1 KB messages: Envoy holds what waits for them at
    about its size. Sent a message at a time, each waited in Envoy as a 4 KiB slice (Envoy
    grew 6.5 MB here where the same with 0.3 KB messages grew 3.2 MB); the relay now sends
    whole pages whole and the rest in pieces Envoy copies, and 16 stalled streams cost less
    than 4 windows each (3.1 MB measured)."""

    def allocated() -> int:
        page = fetch_text(f"http://127.0.0.1:{relay.admin}/memory")
        return int(json.loads(page)["allocated"])

    before = allocated()
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", WINDOW)]
    with grpc.insecure_channel(f"127.0.0.1:{relay.port}", options=options) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = inference_pb2.InferenceRequest(
            prompt=KB_MESSAGES, sampling=inference_pb2.SamplingParams(max_tokens=2000)
        )
        calls = [stub.Generate(request, timeout=60) for _ in range(STALLED)]
        for call in calls:
            next(call)
        # Every stream parked: nothing more comes to Envoy until its caller reads.
        assert relay.metric_within("parks", STALLED, seconds=20) >= STALLED
        grown = allocated() - before
        for call in calls:
            call.cancel()
    assert grown < STALLED * 4 * WINDOW, f"Envoy grew {grown} bytes"


def test_a_move_keeps_of_each_message_only_what_the_next_worker_needs(relay: Relay) -> None:
    """Messages of ~4 kB (their text): the next worker gets the delivered token ids, and the
    relay kept a few bytes of each message, not its text."""
    with grpc.insecure_channel(f"127.0.0.1:{relay.port}") as channel:
        call = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
            inference_pb2.InferenceRequest(
                prompt="pad:4000", sampling=inference_pb2.SamplingParams(max_tokens=TOKENS)
            ),
            timeout=30,
        )
        tokens = list(call)
    assert [t.index for t in tokens] == list(range(TOKENS))
    assert len(tokens[0].text) > 4000
    moved, kept = relay.requests(1)[:2]
    assert moved["delivered"] == [[1000 + i for i in range(DIE_AFTER)]]
    assert 0 < kept["kept_bytes"] <= 16 * DIE_AFTER, kept


@pytest.mark.parametrize("relay", [("cluster=worker", TOKENS)], indirect=True)
def test_a_worker_gone_after_its_last_message_ends_the_stream_ok(relay: Relay) -> None:
    """Killed once its last message (the usage's) went, before its trailers: the caller has the
    whole answer, so the stream ends OK, not moved to another worker that has nothing left to
    generate."""
    tokens, error = generate(relay)
    assert error is None, error
    assert [t.index for t in tokens] == list(range(TOKENS))
    assert relay.requests(1) == []
    assert relay.metric("resumptions", cause="stream_reset") == 0


@pytest.mark.parametrize("relay", [("cluster=worker", TOKENS)], indirect=True)
def test_an_openai_stream_whose_worker_went_after_its_last_part_ends_ok(relay: Relay) -> None:
    """The same for GenerateOpenAI: its last part holds the usage and [DONE], so the caller has
    the whole answer; the stream ends OK and no other worker is asked for what is left."""
    with grpc.insecure_channel(f"127.0.0.1:{relay.port}") as channel:
        call = inference_pb2_grpc.InferenceServiceStub(channel).GenerateOpenAI(
            inference_pb2.InferenceRequest(
                prompt="p",
                sampling=inference_pb2.SamplingParams(max_tokens=TOKENS),
                openai=inference_pb2.OpenAIAnswer(stream=True, relayed=True),
            ),
            timeout=30,
        )
        parts = [inference_pb2.RelayedPart.FromString(part.SerializeToString()) for part in call]
        assert call.code() == grpc.StatusCode.OK, call.details()
    assert [part.token.index for part in parts] == list(range(TOKENS))
    assert parts[-1].data.endswith(b"data: [DONE]\n\n")
    assert relay.requests(1) == []
    assert relay.metric("resumptions", cause="stream_reset") == 0


def test_a_workers_own_error_reaches_the_caller_as_it_is(relay: Relay) -> None:
    tokens, error = generate(relay, max_tokens=0)
    assert tokens == []
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith("sampling.max_tokens")
    assert [r for r in relay.requests(0) if "delivered" in r] == [{"delivered": [], "attempt": 0}]
    assert relay.requests(1) == []
