"""The server's tracer provider comes from its environment: jitflow's variable, OpenTelemetry's own
``OTEL_TRACES_EXPORTER`` and ``OTEL_SERVICE_NAME``, or nothing (each case in a fresh interpreter, since a
provider can be installed once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json
from opentelemetry import trace
from jitflow_server.api.tracing import setup_tracing_from_env
setup_tracing_from_env()
p = trace.get_tracer_provider()
print(json.dumps({"type": type(p).__name__,
                  "service": dict(getattr(p, "resource", None).attributes).get("service.name")
                  if hasattr(p, "resource") else None}))
"""


def _provider(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "JITFLOW_OTEL"))}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("env", "expected"), [
    ({}, {"type": "ProxyTracerProvider", "service": None}),  # nothing asked: the API's no-op
    ({"OTEL_TRACES_EXPORTER": "none"}, {"type": "ProxyTracerProvider", "service": None}),
    ({"OTEL_TRACES_EXPORTER": "console"}, {"type": "TracerProvider", "service": "jitflow-server"}),
    ({"JITFLOW_OTEL_EXPORTER": "console", "OTEL_SERVICE_NAME": "my-llm"},
     {"type": "TracerProvider", "service": "my-llm"}),
])
def test_the_environment_chooses_the_exporter_and_the_service_name(env, expected):
    assert _provider(**env) == expected
