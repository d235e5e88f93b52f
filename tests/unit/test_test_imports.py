"""The product's tests import nothing from loadtests/: what both need (the mesh harness, the
chaos scenarios) lives in tests/harness/, which the load-test tools import. Only the tests of
those tools import them."""

from __future__ import annotations

import ast

from tests.support import ROOT

TESTS = ROOT / "tests"
# The tests of the load-test tools themselves.
TOOL_TESTS = {
    "tests/unit/test_loadgen.py",
    "tests/unit/test_token_cost.py",
    "tests/unit/test_first_token_stages.py",
    "tests/unit/test_prefix_workload.py",
    "tests/unit/test_auth_bench.py",
    "tests/integration/test_loadgen.py",
    "tests/integration/test_loadgen_mesh.py",
}


def imported_modules(source: str) -> set[str]:
    """Every module a Python source imports, at any depth (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def from_loadtests(modules: set[str]) -> set[str]:
    return {name for name in modules if name == "loadtests" or name.startswith("loadtests.")}


def test_imported_modules_sees_every_form_of_import() -> None:
    source = (
        "import loadtests.chaos\n"
        "from loadtests import report\n"
        "def later():\n"
        "    from loadtests.scenarios import second_envoy\n"
        "text = 'from loadtests.runner import run'\n"
    )
    assert from_loadtests(imported_modules(source)) == {
        "loadtests.chaos",
        "loadtests.report",
        "loadtests.scenarios.second_envoy",
    }


def test_only_the_load_test_tools_tests_import_loadtests() -> None:
    offenders = {}
    for path in sorted(TESTS.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name in TOOL_TESTS or "node_modules" in path.parts:
            continue
        imported = from_loadtests(imported_modules(path.read_text()))
        if imported:
            offenders[name] = sorted(imported)
    assert not offenders, offenders
    assert all((ROOT / name).exists() for name in TOOL_TESTS), (
        "a tool test moved: update TOOL_TESTS"
    )
