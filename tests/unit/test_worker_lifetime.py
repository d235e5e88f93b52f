"""The worker's engine processes die with it (tokenmesh.worker.lifetime): a real process tree
started the same way (spawned and forked children, and their own), its root SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support import ROOT
from tokenmesh.worker.lifetime import LAUNCHER, PARENT_PID_VARIABLE, launcher_path

TREE_ROLES = {"parent", "spawned", "forked", "spawned/spawned", "spawned/forked"}


def running(pid: int) -> bool:
    """Whether pid still runs (a killed process waiting to be reaped does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_tree() -> tuple[subprocess.Popen[str], dict[str, int]]:
    tree = subprocess.Popen(
        [sys.executable, "-m", "tests.lifetime_tree"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert tree.stdout is not None
    pids: dict[str, int] = {}
    deadline = time.monotonic() + 60
    while set(pids) != TREE_ROLES and time.monotonic() < deadline:
        line = tree.stdout.readline()
        if not line:
            break
        entry = json.loads(line)
        pids[entry["role"]] = entry["pid"]
    return tree, pids


def test_the_launcher_runs_other_programs_as_they_are() -> None:
    """multiprocessing's resource tracker goes through the launcher too, and must not be tied to
    the worker: it removes the shared memory a killed worker's processes leave."""
    path = launcher_path()
    assert path.parent == Path(sys.executable).parent and path.name == LAUNCHER
    program = "import os, sys; print(sys.argv[1:], sys.flags.dont_write_bytecode, os.getppid())"
    ran = subprocess.run(
        [str(path), "-B", "-c", program, "x", "y"], capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["['x',", "'y']", "1", str(os.getpid())]


def test_sigkill_of_the_root_ends_every_process_of_its_tree_within_5_s() -> None:
    tree, pids = start_tree()
    try:
        assert set(pids) == TREE_ROLES, pids
        descendants = [pid for role, pid in pids.items() if role != "parent"]
        assert all(running(pid) for pid in descendants)
        # Each child's parent is the process that started it (nothing re-parented yet).
        assert psutil.Process(pids["spawned"]).ppid() == pids["parent"]
        assert psutil.Process(pids["spawned/forked"]).ppid() == pids["spawned"]
        os.kill(pids["parent"], signal.SIGKILL)
        killed = time.monotonic()
        while any(running(pid) for pid in descendants) and time.monotonic() - killed < 5:
            time.sleep(0.05)
        left = [role for role, pid in pids.items() if role != "parent" and running(pid)]
        assert not left, f"still running 5 s after the kill: {left}"
    finally:
        tree.kill()
        tree.wait()
        for pid in pids.values():
            if running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("orphaned", [False, True])
def test_a_child_whose_parent_is_already_gone_ends_itself(orphaned: bool) -> None:
    """The race the check covers: the parent died between starting the child and the child
    arming its death signal (the kernel would never send it)."""
    expected = 1 if orphaned else os.getpid()
    program = "from tokenmesh.worker.lifetime import die_with_parent as d; d(); print('ran')"
    child = subprocess.run(
        [sys.executable, "-c", program],
        env={**os.environ, PARENT_PID_VARIABLE: str(expected)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    if orphaned:
        assert child.returncode == -signal.SIGKILL and "ran" not in child.stdout
    else:
        assert child.returncode == 0 and child.stdout.strip() == "ran", child.stderr
