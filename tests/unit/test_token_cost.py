"""The token-cost benchmark's own logic: CPU from /proc, per-token costs, profile summaries."""

from __future__ import annotations

import os
import time
from pathlib import Path

from loadtests import report
from loadtests.profiles import where_time_goes
from loadtests.token_cost import Route, cpu_seconds, per_token, variant_environment


def test_cpu_seconds_count_this_process_busy_work() -> None:
    before = cpu_seconds([os.getpid()])
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    spent = cpu_seconds([os.getpid()]) - before
    assert 0.2 <= spent <= 2.0
    assert cpu_seconds([2**22 + 12345]) == 0.0  # a process that is gone counts nothing


def test_cpu_per_token_is_split_over_envoys_hops() -> None:
    route = Route("edge", "llm", "127.0.0.1:1", "", {}, hops={"envoy": 2})
    result = {"tokens_received": 1000, "cpu_seconds": {"worker": 0.1, "envoy": 0.04}}
    assert per_token(result, route) == {"worker": 100.0, "envoy": 40.0, "envoy_per_hop": 20.0}
    assert per_token({"tokens_received": 0, "cpu_seconds": {}}, route) == {}


def test_a_variants_settings_go_to_the_worker_or_the_mesh() -> None:
    assert variant_environment({"stream_hold_max_ms": "0", "mesh.stream_relay": "false"}) == {
        "TOKENMESH_WORKER_STREAM_HOLD_MAX_MS": "0",
        "TOKENMESH_MESH_STREAM_RELAY": "false",
    }


def test_profile_summary_shares_threads_frames_and_libraries(tmp_path: Path) -> None:
    raw = tmp_path / "worker.txt"
    raw.write_text(
        "thread (1): MainThread;run (tokenmesh/common/server.py:142);"
        "_send (grpc/aio/_call.py:10);grpc_call_start_batch (libgrpc.so) 3\n"
        "thread (1): MainThread;Generate (tokenmesh/worker/servicer.py:80) 1\n"
        "thread (2): vllm-engine;process (vllm/v1/engine/output_processor.py:700) 4\n"
    )
    summary = where_time_goes(raw)
    assert summary["samples"] == 8
    assert summary["threads_percent"] == {
        "thread (1): MainThread": 50.0,
        "thread (2): vllm-engine": 50.0,
    }
    assert summary["innermost_library_percent"] == {
        "vLLM": 50.0,
        "gRPC (C core, Cython, grpc.aio)": 37.5,
        "tokenmesh": 12.5,
    }
    assert summary["frames_percent"]["run (tokenmesh/common/server.py:142)"] == 37.5


def test_first_token_summary_counts_the_slow_ones() -> None:
    from loadtests.first_token import summary

    figures = summary([10.0, 12.0, 300.0, 11.0, 80.0])
    assert figures == {"p50_ms": 12.0, "p90_ms": 300.0, "max_ms": 300.0, "over_50ms_share": 0.4}


def test_the_machine_record_names_the_cpu_and_its_vector_extensions() -> None:
    found = report.processor()
    assert found["cpu_model"]
    flags = next(
        line.partition(":")[2].split()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("flags")
    )
    assert found["cpu_flags"] == [f for f in report.VECTOR_FLAGS if f in flags]
