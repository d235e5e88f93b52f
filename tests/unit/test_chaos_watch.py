"""When the chaos scenarios' kill may strike (tests/harness/chaos.py): every worker seen by
Envoy and by its own count to have streams in flight, a worker held up by flow control
included; and the mesh's session behind the scenarios' clients while they run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.harness.chaos import (
    CLIENT_BYTES,
    TOKEN_BYTES,
    WorkerCount,
    clients_first,
    envoy_sees_streams,
    workers_generating,
)

WORKERS = ["worker-0", "worker-1"]
BEFORE = {name: WorkerCount(messages=100, unfinished=0) for name in WORKERS}
PAGE = """# HELP grpc_server_started_total Total number of RPCs started on the server.
grpc_server_started_total{grpc_type="server_stream",grpc_service="tokenmesh.v1.InferenceService",grpc_method="Generate"} 12.0
grpc_server_started_total{grpc_type="unary",grpc_service="tokenmesh.v1.InferenceService",grpc_method="GetEngineStats"} 5.0
grpc_server_handled_total{grpc_type="server_stream",grpc_service="tokenmesh.v1.InferenceService",grpc_method="Generate",grpc_code="OK"} 7.0
grpc_server_handled_total{grpc_type="server_stream",grpc_service="tokenmesh.v1.InferenceService",grpc_method="Generate",grpc_code="CANCELLED"} 2.0
grpc_server_handled_total{grpc_type="unary",grpc_service="tokenmesh.v1.InferenceService",grpc_method="GetEngineStats",grpc_code="OK"} 5.0
grpc_server_stream_msg_sent_total{grpc_type="server_stream",grpc_service="tokenmesh.v1.InferenceService",grpc_method="Generate"} 4321.0
"""  # noqa: E501


def test_a_workers_count_is_its_generate_streams_alone() -> None:
    assert WorkerCount.of(PAGE) == WorkerCount(messages=4321, unfinished=3)


def test_envoy_must_see_streams_on_every_worker_and_their_tokens() -> None:
    assert envoy_sees_streams({"worker-0": 3, "worker-1": 2}, 5 * TOKEN_BYTES, None)
    assert not envoy_sees_streams({"worker-0": 3, "worker-1": 0}, 10**6, None)
    assert not envoy_sees_streams({}, 10**6, None)
    assert not envoy_sees_streams({"worker-0": 3, "worker-1": 2}, 5 * TOKEN_BYTES - 1, None)
    # Envoy's own kill also needs the clients' answers' headers and first tokens sent.
    assert envoy_sees_streams({"worker-0": 1, "worker-1": 1}, 10**6, 2 * CLIENT_BYTES)
    assert not envoy_sees_streams({"worker-0": 1, "worker-1": 1}, 10**6, 2 * CLIENT_BYTES - 1)


def counts(messages: float, unfinished: float) -> dict[str, WorkerCount]:
    """worker-0 answered and in flight, worker-1 as given."""
    return {
        "worker-0": WorkerCount(messages=600, unfinished=4),
        "worker-1": WorkerCount(messages=messages, unfinished=unfinished),
    }


def test_a_worker_held_up_by_flow_control_is_in_flight() -> None:
    # Its writes wait for a client that stopped reading: no message since the last look, but
    # streams it has not finished, which its kill cuts.
    assert workers_generating(WORKERS, BEFORE, counts(600, 4), in_flight=True)


def test_a_worker_that_finished_its_streams_is_not_in_flight() -> None:
    # It wrote every token (Envoy may still hold them for slow readers): a kill cuts nothing.
    assert not workers_generating(WORKERS, BEFORE, counts(900, 0), in_flight=True)
    # Envoy's own kill cuts whatever Envoy holds open: answered is enough.
    assert workers_generating(WORKERS, BEFORE, counts(900, 0), in_flight=False)


def test_a_worker_that_has_not_answered_or_does_not_answer_is_not_generating() -> None:
    # Streams open but no token sent yet (an engine not started): Envoy would retry them.
    assert not workers_generating(WORKERS, BEFORE, counts(100, 4), in_flight=True)
    assert not workers_generating(WORKERS, BEFORE, counts(100, 4), in_flight=False)
    # A worker too busy to answer its metrics in time is asked again at the next look.
    missing = {"worker-0": WorkerCount(messages=600, unfinished=4)}
    assert not workers_generating(WORKERS, BEFORE, missing, in_flight=True)
    assert not workers_generating(WORKERS, {}, counts(600, 4), in_flight=True)


class SessionOf:
    """A LocalMesh as clients_first sees one: its supervisord is `pid`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def supervisord_pid(self) -> int:
        return self.pid


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="no autogroups here")
def test_the_mesh_runs_behind_the_clients_then_as_it_was() -> None:
    # A process in a session (so an autogroup) of its own stands for supervisord's.
    with subprocess.Popen(["sleep", "30"], start_new_session=True) as child:
        group = Path(f"/proc/{child.pid}/autogroup")
        try:
            with clients_first(SessionOf(child.pid), nice=7) as previous:  # type: ignore[arg-type]
                assert previous == 0
                assert group.read_text().split()[-1] == "7"
            assert group.read_text().split()[-1] == "0"
        finally:
            child.kill()
