"""The engine's processes: found below the worker; its engine core placed by engine_affinity
while the runner keeps the cores vLLM bound it to."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import pytest
from pydantic import ValidationError

from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.placement import bound_cores, descendants, place_engine

# A process standing for the worker: it starts one for vLLM's engine core, which starts one
# bound to a core (as vLLM binds its model runner) and a thread of its own; the worker prints
# both pids and waits. The tests place the engine below it, never below pytest (whose own
# children, in a whole test session, include real services and engines).
WORKER = """
import subprocess, sys, time
engine = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]],
                          stdout=subprocess.PIPE, text=True)
print(engine.pid, engine.stdout.readline().strip(), flush=True)
time.sleep(60)
"""
ENGINE = """
import os, subprocess, sys, threading, time
core = sys.argv[1]
runner = subprocess.Popen([sys.executable, "-c",
    "import os, time; os.sched_setaffinity(0, {%s}); print('bound', flush=True); time.sleep(60)"
    % core], stdout=subprocess.PIPE, text=True)
runner.stdout.readline()
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print(runner.pid, flush=True)
time.sleep(60)
"""
IDLE = "import time; print(0, flush=True); time.sleep(60)"  # no runner: prints pid 0


def threads_cores(process: int) -> set[frozenset[int]]:
    return {
        frozenset(os.sched_getaffinity(int(thread)))
        for thread in os.listdir(f"/proc/{process}/task")
    }


class Engine(NamedTuple):
    worker: int
    engine_core: int
    runner: int
    core: frozenset[int]  # the runner's
    machine: frozenset[int]


@contextmanager
def worker_process(engine_program: str, core: int) -> Iterator[tuple[int, int, int]]:
    """(worker, engine core, runner) pids; the worker and all below it end with the block."""
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, engine_program, str(core)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        engine_core, runner = worker.stdout.readline().split()  # type: ignore[union-attr]
        yield worker.pid, int(engine_core), int(runner)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(10)


@pytest.fixture
def engine() -> Iterator[Engine]:
    allowed = frozenset(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"needs 2 cores to tell a bound process from the rest, this one has {allowed}")
    core = min(allowed)
    with worker_process(ENGINE, core) as (worker, engine_core, runner):
        yield Engine(worker, engine_core, runner, frozenset({core}), allowed)


def test_the_engines_processes_are_found_below_the_worker(engine: Engine) -> None:
    assert set(descendants(engine.worker)) == {engine.engine_core, engine.runner}
    assert set(descendants(engine.engine_core)) == {engine.runner}


def test_the_narrowest_binding_is_the_runners_and_none_means_none(engine: Engine) -> None:
    assert bound_cores([engine.engine_core, engine.runner], engine.machine) == engine.core
    assert bound_cores([engine.engine_core], engine.machine) == frozenset()
    assert bound_cores([], engine.machine) == frozenset()


def test_runner_moves_the_engine_core_onto_the_runners_cores(engine: Engine) -> None:
    # Before: the engine core's threads may use every core.
    assert threads_cores(engine.engine_core) == {engine.machine}
    assert place_engine("runner", engine.worker) == engine.core
    assert threads_cores(engine.engine_core) == {engine.core}
    assert threads_cores(engine.runner) == {engine.core}


def test_a_core_list_gives_the_engine_core_its_own_and_the_runner_keeps_its(
    engine: Engine,
) -> None:
    own = frozenset({max(engine.machine)})
    assert place_engine(str(max(engine.machine)), engine.worker) == own
    assert threads_cores(engine.engine_core) == {own}
    assert threads_cores(engine.runner) == {engine.core}


def test_any_leaves_every_process_where_it_started(engine: Engine) -> None:
    assert place_engine("any", engine.worker) == frozenset()
    assert threads_cores(engine.engine_core) == {engine.machine}
    assert threads_cores(engine.runner) == {engine.core}


def test_nothing_moves_when_no_engine_process_is_bound() -> None:
    with worker_process(IDLE, 0) as (worker, engine_core, _):
        assert place_engine("runner", worker) == frozenset()
        assert threads_cores(engine_core) == {frozenset(os.sched_getaffinity(0))}


@pytest.mark.parametrize("value", ["runner", "any", "0"])
def test_engine_affinity_takes_runner_any_or_cores(value: str) -> None:
    assert WorkerSettings(engine_affinity=value).engine_affinity == value


@pytest.mark.parametrize("value", ["x", "3-1", ""])
def test_a_bad_engine_affinity_is_refused_naming_the_setting(value: str) -> None:
    with pytest.raises(ValidationError) as error:
        WorkerSettings(engine_affinity=value)
    assert "engine_affinity" in str(error.value)


def test_an_engine_affinity_core_the_machine_lacks_is_refused() -> None:
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValidationError) as error:
        WorkerSettings(engine_affinity=str(missing))
    assert "engine_affinity" in str(error.value) and f"[{missing}]" in str(error.value)
