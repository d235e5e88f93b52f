"""Structured logging set-up, called once from each service's entrypoint."""

from __future__ import annotations

import logging
import sys

from opentelemetry import trace
from pythonjsonlogger.json import JsonFormatter


class TraceIdFilter(logging.Filter):
    """Adds trace_id and span_id to records logged while a span is current (tracing on)."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        if context.is_valid and not hasattr(record, "trace_id"):
            record.trace_id = trace.format_trace_id(context.trace_id)
            record.span_id = trace.format_span_id(context.span_id)
        return True


def configure_logging(level: str, log_format: str) -> None:
    """Send the root logger to stderr as JSON lines (or plain text) at the given level."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(TraceIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
