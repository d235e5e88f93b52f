"""Stopping a child process and what it started: the tests' and the load-test tools' servers,
Envoys and agents."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Any


def stop_process(process: subprocess.Popen[Any], grace: float) -> int:
    """SIGTERM the process, give it `grace` seconds to exit, then SIGKILL what is left of it
    and of its process group (children it did not stop, when it was started with
    start_new_session=True); reap it and return its exit code (negative: the signal that
    ended it).

    SIGTERM goes to the process alone: a service stops its own children in order (vLLM's
    engine core). SIGCONT goes with it, as a stopped process (SIGSTOP) cannot act on SIGTERM.
    """
    if process.poll() is None:
        process.send_signal(signal.SIGCONT)
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    # No group has the process's id unless it leads one; the kernel does not give a group's id
    # to another process while the group has members.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.kill()  # a no-op once it has been reaped
    return process.wait()
