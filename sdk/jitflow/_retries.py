"""The clients' retry policy for 429/503 answers: which errors are retried, how long to wait first
(the server's ``Retry-After``, else exponential back-off with jitter), and the deadline rule (never
wait past the call's deadline), as the hooks the clients hand to tenacity.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING, Any

from ._exceptions import APIConnectionError, APIError, APIStatusError, APITimeoutError

if TYPE_CHECKING:  # pragma: no cover
    from opentelemetry.trace import Span
    from tenacity import RetryCallState

    from ._calls import LLMCall

DEFAULT_MAX_RETRIES = 2
"""Retries after the first attempt (``max_retries``; 0 disables them) of a 429/503 answer or of a
connection that failed before any answer (reset, refused, closed keep-alive), as the OpenAI client does."""
RETRY_STATUSES = frozenset({429, 503})
INITIAL_RETRY_DELAY = 0.5  # s: first back-off when the server sent no Retry-After; doubles per retry
MAX_BACKOFF = 8.0  # s: cap of that back-off
MAX_RETRY_DELAY = 60.0  # s: cap of any wait, Retry-After included
MIN_RETRY_SLO_S = 0.001  # s: floor of a retry's shortened deadline / TTFT (the server needs a value > 0)

logger = logging.getLogger("jitflow")


def check_max_retries(value: Any) -> int:
    """``value`` if it is an int >= 0 (not a bool), else ValueError naming ``max_retries``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"max_retries must be an int >= 0, got {value!r}")
    return value


def retry_delay(error: BaseException, retry: int) -> float:
    """Seconds to wait before retry number ``retry`` (1-based): the server's ``Retry-After``
    (``error.retry_after``) when it sent one, else ``0.5 * 2**(retry-1)`` capped at 8 s, less up
    to 25 % jitter; never more than 60 s."""
    after = getattr(error, "retry_after", None)
    if after is None:
        backoff = min(INITIAL_RETRY_DELAY * 2 ** min(retry - 1, 30), MAX_BACKOFF)
        after = backoff * (1 - 0.25 * random.random())
    return min(max(float(after), 0.0), MAX_RETRY_DELAY)


class RetryPolicy:
    """Retry decisions for one logical LLM call, as tenacity hooks (``**policy.options()``).

    Retried: an :class:`APIStatusError` with status 429 or 503 (the clients raise those only
    before any response body is consumed) and an :class:`APIConnectionError` that is not a timeout
    (no answer came: a refused or reset connection, or a keep-alive connection the server closed as
    the request went out; measured: one agent task in a demo run failed on such a ``ReadError``), at
    most ``max_retries`` times, and only while ``now + delay`` does not pass ``deadline_at`` (unix s;
    else the error is raised at once).
    The delay is computed once per attempt, so tenacity may call ``wait`` and ``stop`` in
    either order (it did change between versions).

    Args:
        max_retries: retries after the first attempt.
        deadline_at: the call's absolute deadline in unix seconds, or None.
        label: names the call in log lines (e.g. ``"chat demo"``).
        span: the call's OpenTelemetry span: each retry adds a ``jitflow.retry`` event and sets
            ``jitflow.attempts``.
    """

    def __init__(self, max_retries: int, deadline_at: float | None, label: str, span: Span | None) -> None:
        self.max_retries = max_retries
        self.deadline_at = deadline_at
        self.label = label
        self.span = span
        self.attempts = 0
        self._delay: tuple[int, float] | None = None
        self._first_sent: float | None = None  # unix s: when the first attempt started (set by started())

    @classmethod
    def for_call(cls, max_retries: int, call: LLMCall) -> RetryPolicy:
        """The policy of a begun ``LLMCall``. Its deadline is the earlier of ``now + slo.deadline``
        (a Deadline or Compound SLO) and the task's ``deadline_at`` (a call in a compound-task
        stage that is not best-effort); None when neither applies (Latency, BestEffort, no SLO)."""
        bounds = []
        deadline = getattr(call.slo, "deadline", None)
        if deadline is not None:
            bounds.append(time.time() + deadline)
        if call.task is not None and call.stage is not None and not call.stage.best_effort:
            bounds.append(call.task.deadline_at)
        return cls(max_retries, min(bounds, default=None), f"{call.operation} {call.model}", call._span)

    def body_for_attempt(self, body: dict[str, Any]) -> dict[str, Any]:
        """The request body of the attempt about to be sent: ``body`` itself the first time; on a retry a
        copy whose ``slo`` keeps the client's own due times. The server measures an SLO from the arrival
        of the request it receives, so a retry that resent ``deadline: 28.6`` after 20 s of waiting would
        be scheduled, admitted and reported as met against a deadline 20 s later than the caller's. A
        retry's ``deadline`` and ``ttft`` are therefore shortened by the seconds since the first attempt
        was sent (floored at 1 ms: the server then judges it infeasible and says so); token ``i`` of a
        latency SLO stays due at ``first send + ttft + (i−1)·tbt``."""
        slo = body.get("slo")
        if self.attempts <= 1 or self._first_sent is None or not isinstance(slo, dict):
            return body
        elapsed = time.time() - self._first_sent
        shifted = dict(slo)
        for key in ("deadline", "ttft"):
            val = slo.get(key)
            if isinstance(val, (int, float)) and not isinstance(val, bool):
                shifted[key] = max(float(val) - elapsed, MIN_RETRY_SLO_S)
        return {**body, "slo": shifted}

    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``tenacity.Retrying`` / ``AsyncRetrying``."""
        return dict(retry=self.retry, stop=self.stop, wait=self.wait, before_sleep=self.before_sleep,
                    reraise=True)

    def started(self) -> None:
        """Count an attempt (call at the start of each one, before :meth:`body_for_attempt`)."""
        self.attempts += 1
        if self.attempts == 1:
            self._first_sent = time.time()
        if self.attempts > 1 and self.span is not None:
            self.span.set_attribute("jitflow.attempts", self.attempts)

    def failed(self, error: BaseException) -> BaseException:
        """Stamp ``error.attempts`` (APIError only) and return ``error``."""
        if isinstance(error, APIError):
            error.attempts = max(self.attempts, 1)
        return error

    @staticmethod
    def _error(retry_state: RetryCallState) -> BaseException | None:
        outcome = retry_state.outcome
        return outcome.exception() if outcome is not None and outcome.failed else None

    def retry(self, retry_state: RetryCallState) -> bool:
        error = self._error(retry_state)
        if isinstance(error, APIConnectionError) and not isinstance(error, APITimeoutError):
            return True
        return isinstance(error, APIStatusError) and error.status_code in RETRY_STATUSES

    def wait(self, retry_state: RetryCallState) -> float:
        n = retry_state.attempt_number
        if self._delay is None or self._delay[0] != n:
            error = self._error(retry_state)
            self._delay = (n, retry_delay(error, n) if error is not None else 0.0)
        return self._delay[1]

    def stop(self, retry_state: RetryCallState) -> bool:
        if retry_state.attempt_number > self.max_retries:
            if self.max_retries:
                logger.info("%s: %s; giving up after %d attempts", self.label, self._describe(retry_state),
                            retry_state.attempt_number)
            return True
        delay = self.wait(retry_state)
        if self.deadline_at is not None and time.time() + delay > self.deadline_at:
            logger.info("%s: %s; not retrying: waiting %.2f s would pass the deadline (%.2f s left)",
                        self.label, self._describe(retry_state), delay, self.deadline_at - time.time())
            return True
        return False

    def before_sleep(self, retry_state: RetryCallState) -> None:
        n, delay = retry_state.attempt_number, self.wait(retry_state)
        logger.info("%s: %s; retry %d of %d in %.2f s", self.label, self._describe(retry_state), n,
                    self.max_retries, delay)
        if self.span is not None:
            self.span.add_event("jitflow.retry", {"jitflow.attempt": n, "jitflow.retry_delay": delay})

    def _describe(self, retry_state: RetryCallState) -> str:
        error = self._error(retry_state)
        return f"HTTP {getattr(error, 'status_code', '?')} {type(error).__name__}"
