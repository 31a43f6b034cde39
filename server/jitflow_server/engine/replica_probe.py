"""What a router front end knows of each remote vLLM replica: alive or not, its queue, its measured speed.

A replica is a vLLM OpenAI-compatible server (``jitflow vllm-serve`` or ``vllm serve --scheduler-cls
jitflow_server.engine.plugin.JitflowScheduler``). :class:`ReplicaProbe` reads the replica's Prometheus
``/metrics`` every ``period`` seconds (vLLM's own counters, so work sent by other clients counts too):

- **health**: a replica that does not answer ``/metrics`` within ``timeout`` twice in a row while none
  of its streams sent the front end a token either, or that refuses a connection, is *down*: nothing
  new is routed to it and the front end re-routes the requests it was holding that had not produced a
  token. The next successful read marks it *up* again. A replica's HTTP server is slow to answer
  ``/metrics`` while it streams many tokens (measured on 2 cores: 13 s while streaming 5,000 tokens/s),
  so a replica whose streams are moving counts as alive whatever its ``/metrics`` does.
- **queue**: ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``.
- **speed** (:class:`SpeedEstimate`): output tokens per second from the tokens the front end received
  from the replica's streams per second of the time it had requests in flight there, and from the
  rise of ``vllm:generation_tokens_total`` between two reads while the replica had requests running
  (the first counts what reaches clients even when the replica's HTTP server, not its engine, is the
  bottleneck; the second counts other clients' work too); prompt tokens per second from
  ``vllm:prompt_tokens_total`` over ``vllm:request_prefill_time_seconds_sum``.
  The router needs the throughput of a full batch, but a replica is often measured at a partial one,
  so the output estimate keeps the highest rate seen, forgetting it with a half-life of
  ``half_life_s`` seconds (a replica that became slower is believed within a minute or two).
  Until a replica has been measured it is assumed to be as fast as the fastest measured one (or the
  prior), so a new replica gets work and is measured.

Thread model: one :class:`ReplicaProbe` per replica; :meth:`ReplicaProbe.probe` runs on the router's
probe thread and writes plain attributes the event loop reads (each write is one assignment).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

#: Metrics read from each replica (vLLM's names; a counter's samples carry a ``_total`` suffix).
GEN_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
PREFILL_TIME = "vllm:request_prefill_time_seconds_sum"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
_WANTED = (GEN_TOKENS, PROMPT_TOKENS, PREFILL_TIME, RUNNING, WAITING)
#: Busy seconds over which the average output rate of a replica's streams is taken.
AVERAGE_BUSY_S = 60.0


def read_vllm_metrics(text: str) -> dict[str, float]:
    """The replica-level values of :data:`_WANTED` in a Prometheus text exposition, summed over label
    sets (one per model/engine). Missing metrics are absent from the result. Raises ``ValueError`` on
    text that is not Prometheus' format."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in _WANTED:
                out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


@dataclass
class SpeedEstimate:
    """A replica's measured speed: ``output_tok_s`` (highest recent output rate while busy, decayed
    with ``half_life_s``) and ``prefill_tok_s`` (prompt tokens per second of prefill time), ``None``
    until measured. Units: tokens per second."""

    output_tok_s: float | None = None
    prefill_tok_s: float | None = None
    half_life_s: float = 60.0

    def observe_output(self, rate: float, dt: float) -> None:
        """A busy window of ``dt`` seconds that produced ``rate`` output tokens per second."""
        if not (rate > 0 and math.isfinite(rate)):
            return
        if self.output_tok_s is None:
            self.output_tok_s = rate
            return
        decayed = self.output_tok_s * 0.5 ** (dt / self.half_life_s)
        self.output_tok_s = max(rate, decayed)

    def observe_prefill(self, tokens: float, seconds: float) -> None:
        """``tokens`` prompt tokens prefilled in ``seconds`` of prefill time (an exponential average)."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        self.prefill_tok_s = rate if self.prefill_tok_s is None else 0.7 * self.prefill_tok_s + 0.3 * rate


class ReplicaProbe:
    """One remote replica as the router sees it (module docstring).

    ``url``: the replica's base URL (``http://host:port``, no ``/v1``); ``timeout``: seconds a probe
    may take; ``period``: seconds between probes; ``down_after``: failed probes in a row that make the
    replica down.
    """

    def __init__(self, url: str, *, timeout: float = 2.0, period: float = 1.0, down_after: int = 2,
                 half_life_s: float = 60.0, headers: dict[str, str] | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.period = period
        self.down_after = down_after
        self.headers = headers or {}
        self.up = False
        self.failures = 0  # probes failed in a row
        self.last_error: str | None = None
        self.last_seen: float | None = None  # unix s of the last good probe
        self.running = 0.0
        self.waiting = 0.0
        self.speed = SpeedEstimate(half_life_s=half_life_s)
        self.served_models: list[str] = []
        self.max_model_len: int | None = None
        self._prev: tuple[float, dict[str, float]] | None = None  # (monotonic s, metrics)
        self.last_progress = float("-inf")  # monotonic s when one of its streams last sent a token
        self.in_flight = 0  # the front end's requests on this replica
        self.streamed = 0  # output tokens received from its streams
        self._busy_s = 0.0  # seconds with at least one request in flight, up to _busy_since
        self._busy_since: float | None = None
        self._history: deque[tuple[float, int]] = deque([(0.0, 0)])  # (busy s, streamed) per probe

    def request_started(self) -> None:
        """The front end sent the replica a request (event loop)."""
        if self.in_flight == 0:
            self._busy_since = time.monotonic()
        self.in_flight += 1

    def request_ended(self) -> None:
        """One of the front end's requests on the replica ended, however it ended (event loop)."""
        self.in_flight -= 1
        if self.in_flight == 0 and self._busy_since is not None:
            self._busy_s += time.monotonic() - self._busy_since
            self._busy_since = None

    def note_progress(self, tokens: int) -> None:
        """One of the replica's streams sent ``tokens`` output tokens: it is alive (event loop)."""
        self.last_progress = time.monotonic()
        self.streamed += tokens

    def busy_seconds(self) -> float:
        """Seconds so far during which the front end had a request in flight on the replica."""
        since = self._busy_since
        return self._busy_s + (time.monotonic() - since if since is not None else 0.0)

    def _observe_streams(self) -> None:
        """Output rate per busy second since the last probe, and over the last ``AVERAGE_BUSY_S`` busy
        seconds (a window that began with prefill alone reads low; the longer average keeps one such
        reading from starving a fast replica of the work that would measure it again)."""
        busy, n = self.busy_seconds(), self.streamed
        b1, n1 = self._history[-1]  # at the last probe
        if busy - b1 > 0.05 and n > n1:
            self.speed.observe_output((n - n1) / (busy - b1), busy - b1)
        self._history.append((busy, n))
        while len(self._history) > 2 and busy - self._history[1][0] >= AVERAGE_BUSY_S:
            self._history.popleft()
        b0, n0 = self._history[0]
        if busy - b0 > 0.05 and n > n0:
            self.speed.observe_output((n - n0) / (busy - b0), 0.0)

    def describe(self) -> str:
        """``url (up|down[: error])`` for logs and errors."""
        return f"{self.url} ({'up' if self.up else 'down' + (': ' + self.last_error if self.last_error else '')})"

    def mark_down(self, error: str) -> None:
        """Take the replica out of routing now (a request could not connect to it)."""
        self.up = False
        self.failures = max(self.failures, self.down_after)
        self.last_error = error
        self._prev = None

    def read_models(self, client: httpx.Client) -> None:
        """Read ``/v1/models``: the served model ids and ``max_model_len``. Raises ``httpx.HTTPError``."""
        r = client.get(self.url + "/v1/models", timeout=self.timeout, headers=self.headers)
        r.raise_for_status()
        data = r.json().get("data") or []
        self.served_models = [str(m.get("id")) for m in data]
        lens = [int(m["max_model_len"]) for m in data if isinstance(m.get("max_model_len"), int)]
        self.max_model_len = min(lens) if lens else None

    def probe(self, client: httpx.Client) -> bool:
        """Read ``/metrics`` once and update health, queue and speed; returns whether the replica is up."""
        self._observe_streams()
        try:
            if not self.served_models:
                self.read_models(client)
            r = client.get(self.url + "/metrics", timeout=self.timeout, headers=self.headers)
            r.raise_for_status()
            m = read_vllm_metrics(r.text)
        except (httpx.HTTPError, ValueError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if (isinstance(exc, httpx.TimeoutException)
                    and time.monotonic() - self.last_progress < self.timeout + self.period):
                return self.up  # its streams moved since the last probe: busy, not dead
            self.failures += 1
            if self.failures >= self.down_after:
                self.up = False
                self._prev = None
            return self.up
        now = time.monotonic()
        self.failures = 0
        self.last_error = None
        self.last_seen = time.time()
        self.up = True
        running = m.get(RUNNING, 0.0)
        self.running, self.waiting = running, m.get(WAITING, 0.0)
        if self._prev is not None:
            t0, m0 = self._prev
            dt = now - t0
            busy = running > 0 and m0.get(RUNNING, 0.0) > 0
            d_gen = m.get(GEN_TOKENS, 0.0) - m0.get(GEN_TOKENS, 0.0)
            if busy and dt > 0 and d_gen > 0:
                self.speed.observe_output(d_gen / dt, dt)
            self.speed.observe_prefill(m.get(PROMPT_TOKENS, 0.0) - m0.get(PROMPT_TOKENS, 0.0),
                                       m.get(PREFILL_TIME, 0.0) - m0.get(PREFILL_TIME, 0.0))
        self._prev = (now, m)
        return True
