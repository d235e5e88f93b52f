"""Print pyproject.toml's dependencies and those of the extras named, one a line."""

# The images install these (under the lock's constraints) before the code is copied, so a
# change to the code does not install every dependency again. Standard library only: it runs
# before anything is installed.
from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise SystemExit(f"no such extra in {pyproject}: {', '.join(unknown)}")
    return [*project["dependencies"], *(dep for extra in extras for dep in optional[extra])]


if __name__ == "__main__":
    print("\n".join(requirements(Path("pyproject.toml"), sys.argv[1:])))
