"""stop_process: SIGTERM, a grace period, SIGKILL of the process and its group, reaped."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

from tokenmesh.common.processes import stop_process

# Prints its pid (and its child's, when it starts one) once its SIGTERM handling is set.
PROGRAM = """
import os, signal, subprocess, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = ""
if sys.argv[2] == "child":
    started = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
         "signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
    )
    started.stdout.readline()
    child = str(started.pid)
print(os.getpid(), child, flush=True)
time.sleep(600)
"""


def start(on_sigterm: str, child: bool = False) -> tuple[subprocess.Popen[str], int | None]:
    """A Python process in a session of its own that exits on SIGTERM ("exit") or ignores it
    ("ignore"), with a child that ignores SIGTERM when `child`: the process and the child's pid,
    once both are ready."""
    process = subprocess.Popen(
        [sys.executable, "-c", PROGRAM, on_sigterm, "child" if child else "alone"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    pids = process.stdout.readline().split()
    return process, int(pids[1]) if len(pids) > 1 else None


def gone(pid: int) -> bool:
    """Ended (a zombie whose parent has not reaped it yet has ended too)."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def test_a_process_that_exits_on_sigterm_is_not_killed() -> None:
    process, _ = start("exit")
    assert stop_process(process, grace=30) == -signal.SIGTERM
    assert process.returncode == -signal.SIGTERM


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    process, _ = start("ignore")
    begun = time.monotonic()
    assert stop_process(process, grace=0.5) == -signal.SIGKILL
    assert time.monotonic() - begun >= 0.5


def test_children_left_in_the_group_are_killed_with_it() -> None:
    process, child = start("exit", child=True)
    assert child is not None and not gone(child)
    assert stop_process(process, grace=30) == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while not gone(child):
        assert time.monotonic() < deadline, "the child outlived its group's stop"
        time.sleep(0.05)


def test_a_stopped_process_gets_to_act_on_sigterm() -> None:
    process, _ = start("exit")
    process.send_signal(signal.SIGSTOP)
    begun = time.monotonic()
    assert stop_process(process, grace=30) == -signal.SIGTERM
    assert time.monotonic() - begun < 20


def test_a_process_already_reaped_gives_its_exit_code() -> None:
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    assert stop_process(process, grace=1) == 3
