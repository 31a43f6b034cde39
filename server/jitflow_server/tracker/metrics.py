"""Prometheus metrics of the jitflow server (``GET /metrics``) and the per-request timing record."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jitflow_server.scheduler.types import SLOSpec
from jitflow_server.tracker.goodput import evaluate

_LAT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 40, 60, 120, 300)


@dataclass
class RequestTiming:
    """Measured timeline of one request (unix seconds; lengths in tokens)."""

    request_id: str
    slo: SLOSpec
    arrival: float
    prompt_tokens: int
    token_times: list[float] = field(default_factory=list)
    sub_deadline: float | None = None
    len_bound: int | None = None

    def add_tokens(self, n: int, t: float | None = None) -> None:
        """Record ``n`` tokens emitted at time ``t`` (default now)."""
        t = time.time() if t is None else t
        self.token_times.extend([t] * n)

    def summary(self, finished_ok: bool = True) -> dict:
        """The ``jitflow`` object of responses: TTFT, TBT max/mean, E2EL (s), ``slo_met``."""
        tt = self.token_times
        gaps = [b - a for a, b in zip(tt, tt[1:])]
        res = evaluate(self.slo, self.arrival, tt, self.prompt_tokens, finished_ok=finished_ok)
        return {
            "request_id": self.request_id,
            "kind": self.slo.kind.value,
            "arrival": self.arrival,
            "first_token_time": tt[0] if tt else None,
            "last_token_time": tt[-1] if tt else None,
            "ttft": (tt[0] - self.arrival) if tt else None,
            "tbt_max": max(gaps) if gaps else None,
            "tbt_mean": (sum(gaps) / len(gaps)) if gaps else None,
            "e2el": (tt[-1] - self.arrival) if tt else None,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": len(tt),
            "slo_met": res.slo_met,
            "token_goodput": res.token_goodput,
            "sub_deadline": self.sub_deadline,
            "len_bound": self.len_bound,
        }


#: Distinct ``app`` label values kept; later applications are counted under :data:`OTHER_APP`. Application
#: names come from clients, so an unbounded label would let one client grow every scrape without limit.
MAX_APP_LABELS = 64
#: The ``app`` label of requests outside a compound task.
NO_APP = "-"
#: The ``app`` label of applications beyond :data:`MAX_APP_LABELS`.
OTHER_APP = "other"


class ServerMetrics:
    """Prometheus collectors: requests by kind/outcome/app, goodput and output tokens by kind/app,
    sub-deadline misses by app, TTFT/TBT/E2EL histograms by kind, queue length and engine gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._apps: set[str] = set()
        self.requests = Counter("jitflow_requests", "Finished requests by SLO kind, outcome and application",
                                ["kind", "outcome", "app"], registry=r)
        self.sub_deadline_misses = Counter("jitflow_sub_deadline_misses", "Compound calls that ended after "
                                           "their stage's sub-deadline, by application", ["app"], registry=r)
        self.ttft = Histogram("jitflow_ttft_seconds", "Time to first token", ["kind"], buckets=_LAT_BUCKETS,
                              registry=r)
        self.tbt = Histogram("jitflow_tbt_seconds", "Time between tokens", ["kind"], buckets=_LAT_BUCKETS,
                             registry=r)
        self.e2el = Histogram("jitflow_e2el_seconds", "End-to-end latency", ["kind"], buckets=_LAT_BUCKETS,
                              registry=r)
        self.output_tokens = Counter("jitflow_output_tokens", "Generated tokens", ["kind", "app"], registry=r)
        self.goodput_tokens = Counter("jitflow_goodput_tokens", "Tokens counted as goodput",
                                      ["kind", "app"], registry=r)
        self.queue = Gauge("jitflow_queue_length", "Requests waiting for their first token", registry=r)
        self.in_flight = Gauge("jitflow_requests_in_flight", "Requests being served", registry=r)
        self.engine_waiting = Gauge("jitflow_engine_waiting", "Requests in the engine's waiting queue", registry=r)
        self.engine_running = Gauge("jitflow_engine_running", "Requests in the engine's running set", registry=r)
        self.analyzer_fallbacks = Counter("jitflow_analyzer_fallbacks", "Compound calls served with the fallback "
                                          "advice because the pattern match timed out, was queued too deep or "
                                          "failed", ["reason"], registry=r)

    def app_label(self, app: str | None) -> str:
        """The ``app`` label of ``app``: :data:`NO_APP` for none, the name for the first
        :data:`MAX_APP_LABELS` applications seen, :data:`OTHER_APP` after that."""
        if not app:
            return NO_APP
        if app in self._apps:
            return app
        if len(self._apps) < MAX_APP_LABELS:
            self._apps.add(app)
            return app
        return OTHER_APP

    def observe(self, timing: RequestTiming, outcome: str, summary: dict, app: str | None = None) -> None:
        """Record one finished request (``outcome``: slo_met|slo_missed|best_effort|aborted|rejected|error) of
        application ``app`` (``None`` outside a compound task)."""
        k = timing.slo.kind.value
        a = self.app_label(app)
        self.requests.labels(k, outcome, a).inc()
        tt = timing.token_times
        if timing.sub_deadline is not None and tt and tt[-1] > timing.sub_deadline:
            self.sub_deadline_misses.labels(a).inc()
        if summary.get("ttft") is not None:
            self.ttft.labels(k).observe(summary["ttft"])
        for t0, t1 in zip(tt, tt[1:]):
            self.tbt.labels(k).observe(t1 - t0)
        if summary.get("e2el") is not None:
            self.e2el.labels(k).observe(summary["e2el"])
        self.output_tokens.labels(k, a).inc(len(tt))
        self.goodput_tokens.labels(k, a).inc(summary.get("token_goodput") or 0)

    def render(self) -> bytes:
        """Prometheus text exposition: jitflow's metrics, then vLLM's own ``vllm:*`` ones when the embedded
        engine records them (they live in ``prometheus_client``'s global registry of this process)."""
        return generate_latest(self.registry) + generate_latest(_VllmMetrics())


class _VllmMetrics:
    """A collector view of the ``vllm:*`` families of ``prometheus_client``'s global registry."""

    def collect(self):
        from prometheus_client import REGISTRY

        for family in REGISTRY.collect():
            if family.name.startswith("vllm:"):
                yield family
