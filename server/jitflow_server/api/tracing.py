"""Server-side OpenTelemetry: spans that join the client's trace (W3C trace context).

The server is an application, so it may configure an exporter — but only when the
operator asks for one with ``$JITFLOW_OTEL_EXPORTER`` (or OpenTelemetry's ``$OTEL_TRACES_EXPORTER``,
``console`` or ``otlp``, when that is unset):

- ``console``: JSON spans on stderr;
- ``file:PATH``: one JSON span per line appended to PATH (used by the tests);
- ``otlp``: OTLP/HTTP to ``$OTEL_EXPORTER_OTLP_ENDPOINT`` (needs ``opentelemetry-exporter-otlp``).

A server run under ``opentelemetry-instrument`` (opentelemetry-distro) keeps the provider that set up,
and ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` name the service. Without either, the API's
no-op tracer is used.

Every HTTP request gets the SERVER span of opentelemetry-instrumentation-fastapi (HTTP semantic
conventions, the caller's W3C trace context extracted; ``/health`` and ``/metrics`` excluded). A
generation request adds ``serve {model}`` inside it, with children ``queue`` (arrival -> first token:
queueing, scheduling and prefill) and ``decode`` (first -> last token), carrying GenAI and ``jitflow.*``
attributes. The incoming trace headers are also forwarded to vLLM (its own tracing, when enabled).
"""

from __future__ import annotations

import logging
import os
import sys
import time

from opentelemetry import trace

from jitflow_server.settings import env_settings

logger = logging.getLogger("jitflow.tracing")
_configured = False


def setup_tracing_from_env() -> None:
    """Install a ``TracerProvider`` with the exporter named by ``$JITFLOW_OTEL_EXPORTER``, else by
    OpenTelemetry's own ``$OTEL_TRACES_EXPORTER`` (``console`` or ``otlp``), once; nothing when another
    provider is installed already (``opentelemetry-instrument``)."""
    # Hand-wired rather than through the SDK's environment configurator (what opentelemetry-distro runs):
    # that one is private API (opentelemetry.sdk._configuration), and ``file:PATH``, one JSON span per
    # line, which the tests read, is not one of its exporters. A server run under opentelemetry-instrument
    # is configured by the distro itself and left alone here.
    global _configured
    spec = env_settings().otel_exporter.strip()
    if not spec and os.environ.get("OTEL_TRACES_EXPORTER", "").strip() in ("console", "otlp"):
        spec = os.environ["OTEL_TRACES_EXPORTER"].strip()
    if _configured or not spec or not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win over our default name (Resource.create reads them)
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": "jitflow-server"}))
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


#: Paths without an HTTP span: probes and scrapes, many per minute, nothing to trace.
UNTRACED_PATHS = "/health,/metrics"


def instrument_app(app) -> None:
    """Give every HTTP request of ``app`` (a FastAPI app) its SERVER span, with the FastAPI
    instrumentation package (``jitflow[server]``); a warning and no HTTP spans without it."""
    # the stable HTTP conventions (``http.request.method``, ``http.response.status_code``) unless the
    # operator chose otherwise; the instrumentation still defaults to the old names
    os.environ.setdefault("OTEL_SEMCONV_STABILITY_OPT_IN", "http")
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    except ImportError:
        logger.warning("no HTTP spans: install jitflow[server] (opentelemetry-instrumentation-fastapi)")
        return
    if not getattr(app, "_is_instrumented_by_opentelemetry", False):  # opentelemetry-instrument did it
        # no span per ASGI send/receive: a streamed answer would get one per chunk
        FastAPIInstrumentor.instrument_app(app, excluded_urls=UNTRACED_PATHS, exclude_spans=["send", "receive"])


def tracer() -> trace.Tracer:
    """The server's tracer (no-op unless a provider is installed)."""
    return trace.get_tracer("jitflow.server", "0.1.0")


def start_request_span(model: str, request, timing, *, chat: bool, task_ctx=None) -> trace.Span:
    """Start the span ``serve {model}`` of one request: a child of the HTTP request's SERVER span, or,
    without one (the app not instrumented), of the caller's span named by the request's W3C trace
    headers (``request.trace_headers``). ``timing`` is the request's ``RequestTiming`` (arrival, unix s)."""
    from opentelemetry import propagate

    http_span = trace.get_current_span().get_span_context().is_valid
    context = None if http_span else propagate.extract(dict(request.trace_headers or {}))
    span = tracer().start_span(f"serve {model}", context=context,
                               kind=trace.SpanKind.INTERNAL if http_span else trace.SpanKind.SERVER,
                               start_time=int(timing.arrival * 1e9))
    span.set_attributes({"gen_ai.operation.name": "chat" if chat else "text_completion",
                         "gen_ai.provider.name": "jitflow",
                         "gen_ai.request.model": model, "gen_ai.request.max_tokens": request.max_tokens,
                         "gen_ai.response.id": request.request_id, "jitflow.slo.kind": timing.slo.kind,
                         "gen_ai.usage.input_tokens": timing.prompt_tokens})
    if timing.sub_deadline is not None:
        span.set_attribute("jitflow.sub_deadline", timing.sub_deadline)
    if task_ctx is not None:
        span.set_attributes({"jitflow.task_id": task_ctx.task_id, "jitflow.stage_index": task_ctx.stage_index})
    return span


def end_request_span(span: trace.Span, timing, summary: dict, finish_reason: str | None) -> None:
    """Close the request's SERVER span with ``queue``/``decode`` children from the measured times
    (``summary``: the response's ``jitflow`` object, unix s)."""
    ctx = trace.set_span_in_context(span)
    t_first, t_last = summary.get("first_token_time"), summary.get("last_token_time")
    end = t_last or time.time()
    if t_first is not None:
        tr = tracer()
        q = tr.start_span("queue", context=ctx, start_time=int(timing.arrival * 1e9))
        q.end(end_time=int(t_first * 1e9))
        d = tr.start_span("decode", context=ctx, start_time=int(t_first * 1e9))
        d.set_attribute("gen_ai.usage.output_tokens", summary["output_tokens"])
        d.end(end_time=int(end * 1e9))
    span.set_attributes({"gen_ai.usage.output_tokens": summary["output_tokens"],
                         "gen_ai.response.finish_reasons": [finish_reason or "abort"]})
    for k in ("ttft", "e2el", "slo_met"):
        if summary.get(k) is not None:
            span.set_attribute(f"jitflow.{k}", summary[k])
    span.end(end_time=int(end * 1e9))
