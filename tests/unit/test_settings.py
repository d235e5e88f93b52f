"""Settings come typed from TOKENMESH_<SERVICE>_* variables and are validated at start-up."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tokenmesh.common.server import server_options
from tokenmesh.worker.config import WorkerSettings


def test_worker_reads_its_prefixed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMESH_WORKER_PORT", "6000")
    monkeypatch.setenv("TOKENMESH_WORKER_MAX_TOKENS_CAP", "77")
    monkeypatch.setenv("TOKENMESH_WORKER_MODEL", "/models/llama")
    monkeypatch.setenv("TOKENMESH_GATEWAY_PORT", "7000")
    settings = WorkerSettings()
    assert settings.port == 6000 and settings.max_tokens_cap == 77
    assert settings.model_name == "/models/llama"


def test_invalid_values_fail_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMESH_WORKER_PORT", "70000")
    with pytest.raises(ValidationError, match="port"):
        WorkerSettings()


def test_server_options_carry_keepalive_and_message_caps() -> None:
    options = dict(server_options(WorkerSettings(max_message_bytes=2048)))
    assert options["grpc.keepalive_time_ms"] == 5000
    assert options["grpc.keepalive_timeout_ms"] == 10_000
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.max_receive_message_length"] == 2048
    assert options["grpc.max_send_message_length"] == 2048
