"""The engine's processes: found below the worker; its engine core placed by engine_affinity
while the runner keeps the cores vLLM bound it to."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.placement import bound_cores, descendants, place_engine

# A child standing for vLLM's engine core: it starts a grandchild bound to one core (as vLLM
# binds its model runner), then a thread of its own, prints the runner's pid and waits.
ENGINE = """
import os, subprocess, sys, threading, time
core = int(sys.argv[1])
runner = subprocess.Popen([sys.executable, "-c",
    "import os, time; os.sched_setaffinity(0, {%d}); print('bound', flush=True); time.sleep(60)"
    % core], stdout=subprocess.PIPE, text=True)
runner.stdout.readline()
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print(runner.pid, flush=True)
time.sleep(60)
"""


def threads_cores(process: int) -> set[frozenset[int]]:
    return {
        frozenset(os.sched_getaffinity(int(thread)))
        for thread in os.listdir(f"/proc/{process}/task")
    }


@pytest.fixture
def engine() -> Iterator[tuple[int, int, frozenset[int], frozenset[int]]]:
    """(engine core pid, runner pid, the runner's core, the machine's cores)."""
    allowed = frozenset(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"needs 2 cores to tell a bound process from the rest, this one has {allowed}")
    core = min(allowed)
    child = subprocess.Popen([sys.executable, "-c", ENGINE, str(core)], stdout=subprocess.PIPE)
    try:
        runner = int(child.stdout.readline())  # type: ignore[union-attr]
        yield child.pid, runner, frozenset({core}), allowed
    finally:
        child.kill()
        child.wait(10)


def test_the_engines_processes_are_found_below_the_worker(engine) -> None:  # type: ignore[no-untyped-def]
    engine_core, runner, _, _ = engine
    assert set(descendants(engine_core)) == {runner}
    assert {engine_core, runner} <= set(descendants(os.getpid()))


def test_the_narrowest_binding_is_the_runners_and_none_means_none(engine) -> None:  # type: ignore[no-untyped-def]
    engine_core, runner, core, machine = engine
    assert bound_cores([engine_core, runner], machine) == core
    assert bound_cores([engine_core], machine) == frozenset()
    assert bound_cores([], machine) == frozenset()


def test_runner_moves_the_engine_core_onto_the_runners_cores(engine) -> None:  # type: ignore[no-untyped-def]
    engine_core, runner, core, machine = engine
    # Before: the engine core's threads may use every core.
    assert threads_cores(engine_core) == {machine}
    # The test process stands for the worker: its children are the engine's processes.
    assert place_engine("runner", os.getpid()) == core
    assert threads_cores(engine_core) == {core}
    assert threads_cores(runner) == {core}


def test_a_core_list_gives_the_engine_core_its_own_and_the_runner_keeps_its(engine) -> None:  # type: ignore[no-untyped-def]
    engine_core, runner, core, machine = engine
    own = frozenset({max(machine)})
    assert place_engine(str(max(machine)), os.getpid()) == own
    assert threads_cores(engine_core) == {own}
    assert threads_cores(runner) == {core}


def test_any_leaves_every_process_where_it_started(engine) -> None:  # type: ignore[no-untyped-def]
    engine_core, runner, core, machine = engine
    assert place_engine("any", os.getpid()) == frozenset()
    assert threads_cores(engine_core) == {machine}
    assert threads_cores(runner) == {core}


def test_nothing_moves_when_no_engine_process_is_bound() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for _ in range(100):
            if child.pid in descendants(os.getpid()):
                break
            time.sleep(0.05)
        assert place_engine("runner", os.getpid()) == frozenset()
        assert threads_cores(child.pid) == {frozenset(os.sched_getaffinity(0))}
    finally:
        child.kill()
        child.wait(10)


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
