"""Server-side OpenTelemetry: spans that join the client's trace (W3C trace context).

The server is an application, so it may configure an exporter — but only when the
operator asks for one with ``$JITFLOW_OTEL_EXPORTER``:

- ``console``: JSON spans on stderr;
- ``file:PATH``: one JSON span per line appended to PATH (used by the tests);
- ``otlp``: OTLP/HTTP to ``$OTEL_EXPORTER_OTLP_ENDPOINT`` (needs ``opentelemetry-exporter-otlp``).

Without it the API's no-op tracer is used. Each request gets a SERVER span
``serve {model}`` (child of the caller's ``chat {model}`` span when a ``traceparent``
header is present) with children ``queue`` (arrival -> first token: queueing, scheduling
and prefill) and ``decode`` (first -> last token), carrying GenAI and ``jitflow.*`` attributes.
The incoming trace headers are also forwarded to vLLM (its own tracing, when enabled).
"""

from __future__ import annotations

import logging
import os
import sys

from opentelemetry import trace

logger = logging.getLogger("jitflow.tracing")
_configured = False


def setup_tracing_from_env() -> None:
    """Install a ``TracerProvider`` with the exporter named by ``$JITFLOW_OTEL_EXPORTER`` (once)."""
    global _configured
    spec = os.environ.get("JITFLOW_OTEL_EXPORTER", "").strip()
    if _configured or not spec:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "jitflow-server"}))
    if spec == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    elif spec.startswith("file:"):
        fh = open(spec[5:], "a", buffering=1)  # noqa: SIM115 - lives as long as the provider
        exporter = ConsoleSpanExporter(out=fh, formatter=lambda s: s.to_json(indent=None) + "\n")
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif spec == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            logger.error("JITFLOW_OTEL_EXPORTER=otlp needs `pip install opentelemetry-exporter-otlp`")
            return
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        logger.error("unknown JITFLOW_OTEL_EXPORTER %r (console | file:PATH | otlp)", spec)
        return
    trace.set_tracer_provider(provider)
    _configured = True


def tracer() -> trace.Tracer:
    """The server's tracer (no-op unless a provider is installed)."""
    return trace.get_tracer("jitflow.server", "0.1.0")
