"""docs/security.md's input-limit and edge tables match the settings they document."""

from __future__ import annotations

import re

import pytest
from pydantic_settings import BaseSettings

from tests.support import ROOT
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.reranker.config import RerankerSettings
from tokenmesh.worker.config import WorkerSettings

SETTINGS: dict[str, type[BaseSettings]] = {
    "GATEWAY": GatewaySettings,
    "WORKER": WorkerSettings,
    "RERANKER": RerankerSettings,
    "MESH": MeshSettings,
}
ROW = re.compile(r"^\| `TOKENMESH_(GATEWAY|WORKER|RERANKER|MESH)_([A-Z0-9_]+)` \| `([^`]*)` \|")
# max_* settings that are not limits on what a client sends: connection ageing, the
# services' HTTP/2 stream bound towards Envoy (the edge's own is documented), how many
# tokens the services merge into one message, and how often a stream may move to another
# worker (both in docs/api.md, "Token messages").
NOT_LIMITS = (
    "max_connection_",
    "max_concurrent_streams",
    "max_message_tokens",
    "max_coalesced_",
    "max_resumptions",
)


def documented() -> dict[tuple[str, str], str]:
    text = (ROOT / "docs" / "security.md").read_text()
    section = text[text.index("## Input limits") : text.index("## No prompt text in logs")]
    rows = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            rows[(match[1], match[2].lower())] = match[3]
    return rows


def test_every_documented_default_is_the_settings_default() -> None:
    rows = documented()
    assert len(rows) > 30
    for (service, name), default in rows.items():
        field = SETTINGS[service].model_fields[name]
        value = field.default
        assert (f"{value:g}" if isinstance(value, float) else str(value)) == default, (
            service,
            name,
        )


@pytest.mark.parametrize("service", ["GATEWAY", "WORKER", "RERANKER"])
def test_every_max_setting_of_a_service_is_documented(service: str) -> None:
    rows = documented()
    for name in SETTINGS[service].model_fields:
        if name.startswith("max_") and not name.startswith(NOT_LIMITS):
            assert (service, name) in rows, (
                f"TOKENMESH_{service}_{name.upper()} not in docs/security.md"
            )
