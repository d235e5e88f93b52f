"""The metrics of a worker's front ends on its one metrics port, each series labelled with the
front end that recorded it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from urllib.error import URLError
from urllib.request import urlopen

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# How long a scrape waits for one front end's page; a front end that does not answer in time
# is left out of that scrape (its counters resume at the next).
PAGE_TIMEOUT_SECONDS = 2.0


def fetch_page(port: int) -> str | None:
    try:
        with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=PAGE_TIMEOUT_SECONDS) as page:
            return str(page.read().decode())
    except (URLError, OSError) as error:
        log.warning("front end metrics unavailable", extra={"port": port, "error": str(error)})
        return None


def labelled(pages: Sequence[tuple[str, str]]) -> list[Metric]:
    """The families of several pages (front end, text exposition) as one list, each sample
    with a frontend label; a family on several pages appears once, with every page's samples.
    Each page's series stay apart: summing over the label gives the worker's own totals."""
    families: dict[str, Metric] = {}
    for frontend, text in pages:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                merged.samples.append(
                    sample._replace(labels={**sample.labels, "frontend": frontend})
                )
    return list(families.values())


class FrontendMetrics(Collector):
    """Collects every live front end's own /metrics page at scrape time (ports(): each front
    end's metrics port, 0 while it has none)."""

    def __init__(
        self, ports: Callable[[], Sequence[int]], fetch: Callable[[int], str | None] = fetch_page
    ) -> None:
        self._ports = ports
        self._fetch = fetch

    def collect(self) -> Iterator[Metric]:
        pages = []
        for index, port in enumerate(self._ports()):
            if port > 0 and (text := self._fetch(port)) is not None:
                pages.append((str(index), text))
        yield from labelled(pages)
