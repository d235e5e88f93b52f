"""scripts/check_gpu_lock.py: the GPU lock, never installed here, checked offline against the
snapshot of its wheels' metadata that `make lock-gpu` writes beside it. The real lock passes;
a lock with a planted clash fails, naming the packages: cuda-python 12's own CUDA 12 bindings
beside cuda-bindings 13 (the clash the lock had), a pin another package's requirement rejects,
a requirement the lock does not pin."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

from tests.support import ROOT
from tests.unit.test_locks import make_dry_run

SCRIPT = ROOT / "scripts" / "check_gpu_lock.py"
LOCK = ROOT / "requirements" / "lock-gpu.txt"
METADATA = ROOT / "requirements" / "lock-gpu.metadata.json"
# cuda-python 12.6.2.post1 as the lock had it: its wheel's snapshot and the lock's hashes.
CUDA_PYTHON_12 = Path(__file__).parent / "data" / "cuda-python-12.6.2.post1.json"


def run_check(lock: Path = LOCK, metadata: Path = METADATA) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--lock", str(lock), "--metadata", str(metadata)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def replace_pin(lock: str, name: str, block: str) -> str:
    """The lock with one package's entry (its pin, hashes and annotations) replaced."""
    pattern = re.compile(rf"^{re.escape(name)}==.*?(?=^\S)", re.M | re.S)
    assert pattern.search(lock), name
    return pattern.sub(lambda _: block, lock, count=1)


def planted(
    tmp_path: Path, name: str, block: str, entry: dict[str, object] | None
) -> subprocess.CompletedProcess[str]:
    """Check a copy of the lock and its metadata with one package's pin and snapshot changed
    (removed when entry is None)."""
    metadata = json.loads(METADATA.read_text())
    if entry is None:
        del metadata[name]
    else:
        metadata[name] = entry
    (tmp_path / "lock.txt").write_text(replace_pin(LOCK.read_text(), name, block))
    (tmp_path / "metadata.json").write_text(json.dumps(metadata))
    return run_check(tmp_path / "lock.txt", tmp_path / "metadata.json")


def test_the_gpu_lock_passes_its_check() -> None:
    """Also fails when the lock changed without `make lock-gpu` refreshing the snapshot."""
    result = run_check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_the_gpu_lock_has_cuda_pythons_metapackage_of_cuda_bindings_major() -> None:
    metadata = json.loads(METADATA.read_text())
    bindings = metadata["cuda-bindings"]["version"].split(".")[0]
    assert metadata["cuda-python"]["version"].split(".")[0] == bindings
    assert any(dep.startswith("cuda-bindings") for dep in metadata["cuda-python"]["requires_dist"])


def test_cuda_python_12_beside_cuda_bindings_13_fails_naming_both(tmp_path: Path) -> None:
    entry = json.loads(CUDA_PYTHON_12.read_text())["cuda-python"]
    hashes = "".join(f" \\\n    --hash=sha256:{digest}" for digest in entry.pop("hashes"))
    result = planted(tmp_path, "cuda-python", f"cuda-python==12.6.2.post1{hashes}\n", entry)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert any(
        "cuda-bindings and cuda-python install the same files" in line
        and "cuda/bindings/__init__.py" in line
        for line in lines
    ), result.stdout
    assert any(
        "two majors in cuda/" in line
        and "CUDA 12: cuda-python" in line
        and "CUDA 13: cuda-bindings" in line
        for line in lines
    ), result.stdout


def test_a_pin_another_package_rejects_fails_naming_both(tmp_path: Path) -> None:
    """packaging 19.0, below what wheel (and others) require: pip's resolver would refuse it."""
    entry = json.loads(METADATA.read_text())["packaging"]
    entry["version"] = "19.0"
    block = f"packaging==19.0 \\\n    --hash=sha256:{'0' * 64}\n"
    result = planted(tmp_path, "packaging", block, entry)
    assert result.returncode == 1
    wheel = json.loads(METADATA.read_text())["wheel"]
    needed = next(Requirement(d) for d in wheel["requires_dist"] if d.startswith("packaging"))
    assert f"wheel requires {needed}, but the lock pins packaging==19.0" in result.stdout


def test_a_requirement_the_lock_does_not_pin_fails_naming_it(tmp_path: Path) -> None:
    result = planted(tmp_path, "cuda-pathfinder", "", None)
    assert result.returncode == 1
    assert re.search(
        r"cuda-bindings requires cuda-pathfinder\S*, which the lock does not pin", result.stdout
    ), result.stdout


def test_make_lock_gpu_refreshes_the_snapshot_after_resolving() -> None:
    recipe = make_dry_run("lock-gpu", "LOCK_GPU_VENV=/nonexistent").splitlines()
    written = max(i for i, line in enumerate(recipe) if "> requirements/lock-gpu.txt" in line)
    refresh = [i for i, line in enumerate(recipe) if "scripts/check_gpu_lock.py --refresh" in line]
    assert refresh and refresh[0] > written
    # The floor that keeps cuda-python the metapackage of cuda-bindings.
    assert "'cuda-python>=13'" in "\n".join(recipe)
