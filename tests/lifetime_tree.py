"""A process tree started the way the worker starts its engine (tokenmesh.worker.lifetime), for
tests/unit/test_worker_lifetime.py: `python -m tests.lifetime_tree` prints one JSON line per
process of the tree ({"role", "pid"}), then every process sleeps until it is killed."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

LIFETIME_SECONDS = 120


def report(role: str) -> None:
    print(json.dumps({"role": role, "pid": os.getpid()}), flush=True)


def leaf(role: str) -> None:
    report(role)
    time.sleep(LIFETIME_SECONDS)


def engine_core() -> None:
    """Like vLLM's engine core: spawned itself, it spawns and forks processes of its own."""
    report("spawned")
    multiprocessing.get_context("spawn").Process(target=leaf, args=("spawned/spawned",)).start()
    multiprocessing.get_context("fork").Process(target=leaf, args=("spawned/forked",)).start()
    time.sleep(LIFETIME_SECONDS)


def main() -> None:
    from tokenmesh.worker.lifetime import adopt_children

    adopt_children()
    report("parent")
    multiprocessing.get_context("spawn").Process(target=engine_core).start()
    multiprocessing.get_context("fork").Process(target=leaf, args=("forked",)).start()
    time.sleep(LIFETIME_SECONDS)


if __name__ == "__main__":
    main()
