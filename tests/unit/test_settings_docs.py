"""docs/settings.md's tables are the ones the settings classes render now."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from tests.support import ROOT


def generator() -> ModuleType:
    """scripts/gen_settings_docs.py, imported from its file (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "gen_settings_docs", ROOT / "scripts" / "gen_settings_docs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_settings_page_is_fresh() -> None:
    page = (ROOT / "docs" / "settings.md").read_text()
    assert generator().render(page) == page, (
        "docs/settings.md is stale: a setting changed; run `make docs` and commit the page"
    )


def test_every_setting_of_every_service_is_on_the_page() -> None:
    """The tables list every field, an inherited one under each service's own prefix."""
    gen = generator()
    page = (ROOT / "docs" / "settings.md").read_text()
    for _, cls, _ in gen.SECTIONS:
        prefix = cls.model_config["env_prefix"]
        for name in cls.model_fields:
            if name not in ("breaker", "picker"):  # nested: one row per field, below
                assert f"| `{prefix}{name.upper()}` |" in page, (prefix, name)
    assert "| `TOKENMESH_GATEWAY_BREAKER__OPEN_SECONDS` | `5` |" in page
    assert "| `TOKENMESH_GATEWAY_PICKER__SLACK_STREAMS` | `2` |" in page
    assert "| `TOKENMESH_WORKER_PORT` | `50061` |" in page


def test_every_setting_has_a_description() -> None:
    gen = generator()
    for _, cls, _ in gen.SECTIONS:
        for name in cls.model_fields:
            if name not in ("breaker", "picker"):  # nested: one row per field, below
                assert gen.describe(cls, name), f"{cls.__name__}.{name} has no description"


def test_a_stale_table_is_seen() -> None:
    """The freshness check above can fail: a hand edit between the markers is undone."""
    page = (ROOT / "docs" / "settings.md").read_text()
    edited = page.replace(
        "| `TOKENMESH_WORKER_PORT` | `50061` |", "| `TOKENMESH_WORKER_PORT` | `1` |"
    )
    assert edited != page
    assert generator().render(edited) == page
