"""The server's Prometheus metrics: per-application labels (bounded), goodput per kind and application, and
sub-deadline misses of compound calls, read back from the text exposition."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from jitflow_server.scheduler.types import SLOSpec
from jitflow_server.tracker.metrics import MAX_APP_LABELS, NO_APP, OTHER_APP, RequestTiming, ServerMetrics


def samples(m: ServerMetrics, name: str) -> dict[tuple, float]:
    """``{sorted label items: value}`` of the samples named ``name`` in the exposition."""
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def timing(kind: str, tokens: int, sub_deadline: float | None = None) -> RequestTiming:
    t = RequestTiming("r", SLOSpec(kind, deadline=10.0 if kind != "latency" else None), 100.0, 5,
                      sub_deadline=sub_deadline)
    for i in range(tokens):
        t.add_tokens(1, 100.5 + i)
    return t


def test_requests_and_goodput_are_counted_per_kind_and_application():
    m = ServerMetrics()
    t = timing("compound", 3, sub_deadline=101.0)  # last token at 102.5: after its sub-deadline
    m.observe(t, "slo_met", t.summary(), app="research")
    t2 = timing("deadline", 2)
    m.observe(t2, "slo_met", t2.summary())
    req = samples(m, "jitflow_requests_total")
    assert req[(("app", "research"), ("kind", "compound"), ("outcome", "slo_met"))] == 1
    assert req[(("app", NO_APP), ("kind", "deadline"), ("outcome", "slo_met"))] == 1
    good = samples(m, "jitflow_goodput_tokens_total")
    assert good[(("app", "research"), ("kind", "compound"))] == t.summary()["token_goodput"] > 0
    assert samples(m, "jitflow_sub_deadline_misses_total") == {(("app", "research"),): 1.0}
    on_time = timing("compound", 1, sub_deadline=200.0)
    m.observe(on_time, "slo_met", on_time.summary(), app="research")
    assert samples(m, "jitflow_sub_deadline_misses_total") == {(("app", "research"),): 1.0}


def test_application_labels_are_bounded():
    m = ServerMetrics()
    for i in range(MAX_APP_LABELS + 10):
        t = timing("deadline", 1)
        m.observe(t, "slo_met", t.summary(), app=f"app-{i}")
    apps = {dict(k)["app"] for k in samples(m, "jitflow_requests_total")}
    assert len(apps) == MAX_APP_LABELS + 1 and OTHER_APP in apps
    other = samples(m, "jitflow_requests_total")[(("app", OTHER_APP), ("kind", "deadline"), ("outcome", "slo_met"))]
    assert other == 10
    assert m.app_label("app-0") == "app-0"  # a known application keeps its label
