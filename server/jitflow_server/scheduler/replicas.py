"""Power-of-K replica choice with replica-specific priorities (JITServe §4.3 "Supporting Multiple Models").

For a request r, K dummy copies are scored on K sampled replicas, each with that replica's
measured speed (``SchedContext.token_time``, ``prefill_rate``) and KV locality (a copy on a replica
that does not hold r's KV must prefill again). The copy with the highest priority wins; the other
dummies are dropped. The routing that uses it lives outside the pure core.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from jitflow_server.scheduler.gmax import GMAXPolicy
from jitflow_server.scheduler.types import RequestView, SchedContext


def dummy_copies(view: RequestView, ctxs: Sequence[SchedContext], k: int | None = None,
                 rng: random.Random | None = None, home_replica: int | None = None
                 ) -> list[tuple[int, RequestView, SchedContext]]:
    """The K dummy copies of ``view``: ``(index into ctxs, view as seen on that replica, ctx)``.

    ``k=None`` (or ≥ M) uses all M replicas (the paper: "K can be set equal to M"); otherwise K
    replicas are sampled without replacement with ``rng``. On replicas other than ``home_replica``
    (where its KV lives) the copy is waiting with ``kv_tokens=0`` (it must prefill there).
    Raises ``ValueError`` if ``ctxs`` is empty or ``k < 1``.
    """
    m = len(ctxs)
    if m == 0:
        raise ValueError("need at least one replica context")
    if k is not None and k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    idx = list(range(m))
    if k is not None and k < m:
        idx = (rng or random.Random()).sample(idx, k)
    out = []
    for i in idx:
        home = home_replica is None or ctxs[i].replica == home_replica
        v = view if home else replace(view, running=False, kv_tokens=0)
        out.append((i, v, ctxs[i]))
    return out


def best_replica(view: RequestView, ctxs: Sequence[SchedContext], policy: GMAXPolicy | None = None,
                 k: int | None = None, rng: random.Random | None = None,
                 home_replica: int | None = None) -> tuple[int, float, dict[int, float]]:
    """Score ``view`` on K replicas' contexts and return ``(best index into ctxs, its priority,
    {index: priority})``; ties go to the lower index. ``policy`` defaults to a fresh GMAX policy
    (priority = goodput/t_gen with each replica's own v_token and prefill rate, JITServe §4.3; the
    paper's ranking, ``jit=False``: where a request can still finish matters for routing, not when
    it must start).
    """
    pol = policy or GMAXPolicy(adapt_p=False, jit=False)
    scores: dict[int, float] = {}
    for i, v, ctx in dummy_copies(view, ctxs, k, rng, home_replica):
        scores[i] = float(pol.priorities([v], ctx)[0])
    best = max(sorted(scores), key=lambda i: scores[i])
    return best, scores[best], scores
