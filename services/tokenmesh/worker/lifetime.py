"""Ties the engine's processes to the worker: the kernel kills each when its parent dies."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

# prctl(2) option: the signal this process gets when its parent thread exits.
PR_SET_PDEATHSIG = 1
# The pid of the process whose children are being started; each child checks that it has not
# already lost that parent before its death signal was armed.
PARENT_PID_VARIABLE = "TOKENMESH_ENGINE_PARENT_PID"
# The console script (pyproject.toml) multiprocessing starts spawned children with.
LAUNCHER = "tokenmesh-engine-python"
# What multiprocessing's spawn start method runs in a child (multiprocessing.spawn).
SPAWN_PROGRAM = "from multiprocessing.spawn import spawn_main"
# libc, loaded once here: a forked child must not dlopen (the loader's lock may be held by a
# thread that does not exist in the child).
LIBC = ctypes.CDLL(None, use_errno=True)


def launcher_path() -> Path:
    path = Path(sys.executable).with_name(LAUNCHER)
    if not path.exists():
        raise RuntimeError(
            f"{path} is missing: install the tokenmesh package (pip install -e .) into the "
            "environment the worker runs from"
        )
    return path


def die_with_parent() -> None:
    """Arm PR_SET_PDEATHSIG (SIGKILL) in this process and end it at once if its parent is
    already gone; then record it as the parent its own children check for.

    The kernel sends the signal however the parent ends (SIGKILL, SIGSEGV, the OOM killer, an
    exit after SIGTERM's grace), because it acts on the parent's exit itself, not on anything
    the parent would have to run. It acts on the exit of the parent *thread* that started this
    process, so the worker starts its engine from a thread that lives as long as the engine
    (engine.EngineThread). Each process of the tree does this in turn, so the engine core's
    own workers end with it. prctl through ctypes: one call into libc, where the PyPI
    python-prctl package would need libcap headers to build.
    """
    if LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    expected = os.environ.get(PARENT_PID_VARIABLE)
    if expected is not None and os.getppid() != int(expected):
        os.kill(os.getpid(), signal.SIGKILL)
    os.environ[PARENT_PID_VARIABLE] = str(os.getpid())


def adopt_children() -> None:
    """Once per interpreter: make every child this process starts die with it. Spawned
    children start through the launcher; forked ones inherit the at-fork hook (so a forked
    child must not call this again)."""
    os.environ[PARENT_PID_VARIABLE] = str(os.getpid())
    multiprocessing.set_executable(str(launcher_path()))
    os.register_at_fork(after_in_child=die_with_parent)


def spawned_child() -> None:
    """What the launcher runs first in a spawned child of the engine's tree."""
    die_with_parent()
    adopt_children()


def launch() -> NoReturn:
    """The `tokenmesh-engine-python` launcher: runs Python with the arguments multiprocessing
    gave it, unchanged, except that a spawned child arms its death signal first. Other programs
    (multiprocessing's resource tracker) run as they are: the tracker must outlive a killed
    worker to remove the shared memory the worker's processes left."""
    args = sys.argv[1:]
    if "-c" in args:
        program = args.index("-c") + 1
        if args[program].startswith(SPAWN_PROGRAM):
            args[program] = (
                "from tokenmesh.worker.lifetime import spawned_child; spawned_child(); "
                + args[program]
            )
    os.execv(sys.executable, [sys.executable, *args])
