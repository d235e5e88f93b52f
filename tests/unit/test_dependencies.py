"""Each service has its own dependency set: the gateway and reranker never import vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest


def modules_after_import(module: str) -> set[str]:
    """Top-level package names loaded after importing module in a fresh interpreter."""
    probe = (
        "import importlib, sys\n"
        f"importlib.import_module({module!r})\n"
        "print(' '.join(sorted({name.split('.')[0] for name in sys.modules})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300
    )
    return set(result.stdout.split())


@pytest.mark.parametrize("service", ["gateway", "reranker", "localmesh"])
def test_service_does_not_import_vllm(service: str) -> None:
    assert "vllm" not in modules_after_import(f"tokenmesh.{service}.__main__")


def test_the_probe_sees_vllm_in_the_worker() -> None:
    assert "vllm" in modules_after_import("tokenmesh.worker.__main__")
