"""The endpoint picker's choice: prefix affinity, bounded by the workers' reported load."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import cast

from prometheus_client import CollectorRegistry

from tokenmesh.common.tokens import AFFINITY_HEADER, WORKER_HEADER
from tokenmesh.gateway.config import GatewaySettings, PickerSettings
from tokenmesh.gateway.core.catalog import ModelCatalog
from tokenmesh.gateway.core.documents import DocumentSelector
from tokenmesh.gateway.core.picker import EndpointPicker, PickerMetrics, WorkerLoad, loads, ranking
from tokenmesh.gateway.core.pipeline import Pipeline
from tokenmesh.gateway.core.prepare import Preparer
from tokenmesh.gateway.core.workers import WorkerClient
from tokenmesh.v1 import inference_pb2, ops_pb2

A, B, C = "10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def picker(clock: Clock | None = None, **policy: int | float) -> EndpointPicker:
    return EndpointPicker(PickerSettings(**policy), None, clock or Clock())


def fleet(**queued: int) -> list[WorkerLoad]:
    addresses = {"a": A, "b": B, "c": C}
    return [WorkerLoad(addresses[name], True, count) for name, count in queued.items()]


def test_nothing_is_picked_before_the_first_report_or_with_no_worker_serving() -> None:
    chooser = picker()
    assert chooser.pick("k") == []
    chooser.update([WorkerLoad(A, False, 0), WorkerLoad(B, False, 0)])
    assert chooser.pick("k") == []


def test_every_gateway_sends_a_key_to_its_first_worker_and_keys_spread_evenly() -> None:
    first: Counter[str] = Counter()
    for number in range(300):
        key = f"key {number}"
        # Two gateways' pickers, each with the same report and a stream just sent elsewhere.
        one, other = picker(), picker()
        one.update(fleet(a=0, b=0, c=0))
        other.update(fleet(c=0, b=0, a=0))
        picked = one.pick(key)
        assert picked[0] == ranking(key, [A, B, C])[0] == other.pick(key)[0]
        first[picked[0]] += 1
    # 100 each expected; below 60 has a chance under 1e-5.
    assert min(first[address] for address in (A, B, C)) > 60, first


def test_a_busy_first_worker_spills_the_key_to_its_next_within_the_slack() -> None:
    key = "k"
    first, second, third = ranking(key, [A, B, C])
    chooser = picker(slack_streams=2, slack_percent=0)
    loads = {first: 2, second: 1, third: 0}
    chooser.update([WorkerLoad(address, True, count) for address, count in loads.items()])
    assert chooser.pick(key)[0] == first  # 2 ahead of the least loaded: within the slack
    # Now 3 ahead (the stream just sent counts): the next in the key's ranking, 1 ahead.
    assert chooser.pick(key)[0] == second
    loads = {first: 9, second: 7, third: 0}
    chooser.update([WorkerLoad(address, True, count) for address, count in loads.items()])
    assert chooser.pick(key)[0] == third


def test_the_slack_grows_with_the_load_by_percent() -> None:
    key = "k"
    first, second = ranking(key, [A, B])
    chooser = picker(slack_streams=1, slack_percent=25)
    # 19 ahead of 100 is within 25 % of it (though over one stream); 40 ahead is not.
    chooser.update([WorkerLoad(first, True, 119), WorkerLoad(second, True, 100)])
    assert chooser.pick(key)[0] == first
    chooser.update([WorkerLoad(first, True, 140), WorkerLoad(second, True, 100)])
    assert chooser.pick(key)[0] == second


def test_a_worker_that_stops_serving_or_leaves_moves_only_its_own_keys() -> None:
    keys = [f"key {number}" for number in range(60)]
    chooser = picker(slack_streams=1000)
    chooser.update(fleet(a=0, b=0, c=0))
    before = {key: chooser.pick(key)[0] for key in keys}
    chooser.update([WorkerLoad(A, False, 0), *fleet(b=0, c=0)])
    during = {key: chooser.pick(key) for key in keys}
    assert all(A not in picked for picked in during.values())
    assert all(during[key][0] == before[key] for key in keys if before[key] != A)
    chooser.update(fleet(b=0, c=0))  # gone from the fleet
    assert all(chooser.pick(key)[0] == during[key][0] for key in keys)


def test_stale_or_broken_figures_pick_nothing_until_the_next_report() -> None:
    clock = Clock()
    chooser = picker(clock, stale_seconds=3.0)
    chooser.update(fleet(a=0, b=0))
    clock.now += 2.9
    assert chooser.pick("k")
    clock.now += 0.2
    assert chooser.pick("k") == []
    chooser.update(fleet(a=0, b=0))
    assert chooser.pick("k")
    chooser.forget()
    assert chooser.pick("k") == []


def test_candidates_are_capped_and_a_retry_goes_to_the_least_loaded_of_the_rest() -> None:
    key = "k"
    first, second, third = ranking(key, [A, B, C])
    chooser = picker(candidates=2, slack_streams=1000)
    loads = {first: 0, second: 5, third: 1}
    chooser.update([WorkerLoad(address, True, count) for address, count in loads.items()])
    assert chooser.pick(key) == [first, third]


def test_every_pick_is_counted_by_why_its_worker_was_chosen() -> None:
    registry = CollectorRegistry()
    chooser = EndpointPicker(
        PickerSettings(slack_streams=0, slack_percent=0), PickerMetrics(registry), Clock()
    )
    key = "k"
    first, second = ranking(key, [A, B])
    chooser.pick(key)
    chooser.update([WorkerLoad(first, True, 0), WorkerLoad(second, True, 0)])
    chooser.pick(key)
    chooser.pick(key)  # the first is a stream ahead now

    def picks(choice: str) -> float | None:
        return registry.get_sample_value("tokenmesh_gateway_worker_picks_total", {"choice": choice})

    assert [picks(choice) for choice in ("none", "first", "spilled")] == [1, 1, 1]


def test_a_report_of_a_worker_that_did_not_answer_counts_it_not_serving() -> None:
    snapshot = ops_pb2.WorkersSnapshot(
        workers=[
            ops_pb2.WorkerSnapshot(address=A, serving=True, running_requests=2, waiting_requests=3),
            ops_pb2.WorkerSnapshot(address=B, serving=True, error="UNAVAILABLE: down"),
        ]
    )
    assert loads(snapshot) == [WorkerLoad(A, True, 5), WorkerLoad(B, False, 0)]


def test_a_request_is_placed_among_its_pools_workers_only() -> None:
    chooser = picker()
    # The pool "b" has one idle worker; the default pool's two are busy.
    chooser.update(
        [WorkerLoad(A, True, 30), WorkerLoad(B, True, 40), WorkerLoad(C, True, 0, pool="b")]
    )
    for number in range(20):
        assert chooser.pick(f"key {number}", "b") == [C]
        assert set(chooser.pick(f"key {number}")) == {A, B}
    # A pool none of whose workers serves (or an unknown one): Envoy's own balancing.
    assert chooser.pick("key", "c") == []
    snapshot = ops_pb2.WorkersSnapshot(
        workers=[ops_pb2.WorkerSnapshot(address=C, serving=True, pool="b", model="other")]
    )
    assert loads(snapshot) == [WorkerLoad(C, True, 0, pool="b")]


def test_an_adapters_request_prefers_a_worker_holding_it_within_the_slack() -> None:
    chooser = picker(slack_streams=2)
    key = "adapter key"
    first, second, third = ranking(key, [A, B, C])
    # The key's last worker alone holds the adapter: it is chosen, a load spared.
    held = frozenset({"sql"})
    fleet = [WorkerLoad(first, True, 0), WorkerLoad(second, True, 0), WorkerLoad(third, True, 0)]
    fleet[2] = WorkerLoad(third, True, 0, held=held)
    chooser.update(fleet)
    assert chooser.pick(key, adapter="sql")[0] == third
    # Another adapter, or none: the key's own order.
    assert chooser.pick(key, adapter="chat")[0] == first
    assert chooser.pick(key)[0] == first
    # Past the slack, the holder spills to the key's first, which loads it.
    fleet[2] = WorkerLoad(third, True, 9, held=held)
    chooser.update(fleet)
    assert chooser.pick(key, adapter="sql")[0] == first
    snapshot = ops_pb2.WorkersSnapshot(
        workers=[ops_pb2.WorkerSnapshot(address=A, serving=True, held_adapters=["sql"])]
    )
    assert loads(snapshot) == [WorkerLoad(A, True, 0, held=held)]


class Worker:
    """A WorkerClient that records the metadata of each call and streams nothing."""

    def __init__(self) -> None:
        self.metadata: list[tuple[tuple[str, str], ...]] = []

    def stream(
        self, request: object, time_limit: float | None, metadata: tuple[tuple[str, str], ...]
    ) -> AsyncIterator[object]:
        self.metadata.append(metadata)

        async def tokens() -> AsyncIterator[object]:
            return
            yield

        return tokens()


def test_the_gateways_own_worker_call_names_the_picked_workers() -> None:
    worker = Worker()
    chooser = picker()
    preparer = Preparer(
        cast(DocumentSelector, None), GatewaySettings(), cast(ModelCatalog, None), chooser
    )
    pipeline = Pipeline(cast(WorkerClient, worker), GatewaySettings())
    sampling = inference_pb2.SamplingParams(max_tokens=1)
    pipeline.stream(preparer.call("a prompt", sampling), None)
    chooser.update(fleet(a=0, b=0))
    pipeline.stream(preparer.call("a prompt", sampling), None)
    unpicked, picked = (dict(metadata) for metadata in worker.metadata)
    assert WORKER_HEADER not in unpicked  # no figures yet: Envoy chooses
    assert picked[WORKER_HEADER] == ",".join(ranking(unpicked[AFFINITY_HEADER], [A, B]))
    assert picked[AFFINITY_HEADER] == unpicked[AFFINITY_HEADER]


def worked(queued: dict[str, int], computed: dict[str, int]) -> list[WorkerLoad]:
    return [WorkerLoad(address, True, queued[address], computed[address]) for address in queued]


def test_a_worker_over_the_work_bound_gets_no_slack_until_the_window_forgets() -> None:
    key = "k"
    first, second = ranking(key, [A, B])
    clock = Clock()
    chooser = picker(clock, slack_streams=2, work_bound_percent=125, work_window_seconds=10)
    chooser.update(worked({first: 0, second: 0}, {first: 0, second: 0}))
    clock.now += 5
    # In 5 s the key's first worker computed 3,000 prompt tokens and the other 1,000: 150 % of
    # the mean. One stream ahead of the other, it gets no slack; as idle as it, it keeps the key.
    chooser.update(worked({first: 1, second: 0}, {first: 3000, second: 1000}))
    assert chooser.overworked([first, second]) == {first}
    assert chooser.pick(key)[0] == second
    chooser.update(worked({first: 0, second: 0}, {first: 3000, second: 1000}))
    assert chooser.pick(key)[0] == first
    # 120 % of the mean is within the bound: the slack is back.
    chooser.update(worked({first: 1, second: 0}, {first: 3000, second: 2000}))
    assert chooser.overworked([first, second]) == set()
    assert chooser.pick(key)[0] == first
    # Past the window (reports every 5 s): only the last 10 s count, 500 against 500.
    for _ in range(2):
        clock.now += 5
        chooser.update(worked({first: 1, second: 0}, {first: 3500, second: 2500}))
    assert chooser.work(first) == chooser.work(second) == 500
    clock.now += 5
    chooser.update(worked({first: 1, second: 0}, {first: 4000, second: 2500}))
    assert chooser.work(first) == 500 and chooser.work(second) == 0
    assert chooser.overworked([first, second]) == {first}


def test_the_work_bound_off_and_a_restarted_engine_count_no_false_work() -> None:
    key = "k"
    first, second = ranking(key, [A, B])
    clock = Clock()
    off = picker(clock, slack_streams=2, work_bound_percent=0)
    off.update(worked({first: 1, second: 0}, {first: 0, second: 0}))
    clock.now += 1
    off.update(worked({first: 1, second: 0}, {first: 9000, second: 0}))
    assert off.overworked([first, second]) == set() and off.pick(key)[0] == first
    chooser = picker(clock)
    chooser.update(worked({first: 0, second: 0}, {first: 50_000, second: 800}))
    clock.now += 1
    # The first's engine restarted (its count began again): its window starts anew.
    chooser.update(worked({first: 0, second: 0}, {first: 100, second: 900}))
    assert chooser.work(first) == 0 and chooser.work(second) == 100


def test_a_report_carries_each_workers_computed_prompt_tokens() -> None:
    snapshot = ops_pb2.WorkersSnapshot(
        workers=[
            ops_pb2.WorkerSnapshot(
                address=A, serving=True, prefix_cache_queries=5000, prefix_cache_hits=3500
            )
        ]
    )
    assert loads(snapshot) == [WorkerLoad(A, True, 0, 1500)]
