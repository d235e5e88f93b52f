"""The edge's stream relay (envoy/relay) built for this machine's Envoy: a shared object that
Envoy loads from ENVOY_DYNAMIC_MODULES_SEARCH_PATH (MeshSettings.stream_relay)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

# The relay's sources (every .c file there), relative to the repository.
RELAY_SOURCE = Path("envoy") / "relay"
# What Envoy loads for the module named tokenmesh_relay.
RELAY_LIBRARY = "libtokenmesh_relay.so"
# The environment variable naming the directory Envoy loads dynamic modules from.
SEARCH_PATH = "ENVOY_DYNAMIC_MODULES_SEARCH_PATH"
FLAGS = ["-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared"]


def c_compiler() -> str | None:
    """The C compiler that builds the relay (gcc, else cc), None without one on PATH."""
    return shutil.which("gcc") or shutil.which("cc")


def build_relay_module(source: Path, out_dir: Path) -> Path:
    """The module built from the C files in `source` into out_dir (again only when a source
    is newer): the directory Envoy's ENVOY_DYNAMIC_MODULES_SEARCH_PATH names."""
    library = out_dir / RELAY_LIBRARY
    files = sorted([*source.glob("*.c"), *source.glob("*.h")])
    newest = max(path.stat().st_mtime for path in files)
    if library.exists() and library.stat().st_mtime >= newest:
        return library
    compiler = c_compiler()
    if compiler is None:
        raise RuntimeError(
            "stream_relay needs a C compiler (gcc or cc on PATH) to build the edge's relay "
            f"({source}); install gcc, or turn stream_relay off"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    built = out_dir / (RELAY_LIBRARY + ".new")
    sources = [str(path) for path in files if path.suffix == ".c"]
    subprocess.run([compiler, *FLAGS, "-o", str(built), *sources], check=True)
    built.replace(library)  # whole: an Envoy starting meanwhile never loads half a file
    return library
