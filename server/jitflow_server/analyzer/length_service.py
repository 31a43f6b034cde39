"""Asynchronous, batched length-bound service: keeps predictions off the scheduling path.

JITServe §4.1 (refinement every 50 tokens). The scheduler never waits for the
forest: :meth:`LengthService.submit` records the request and returns immediately (setting a cheap
provisional bound if it has none yet), a single background worker thread drains the queue in
batches (up to ``max_batch`` requests per forest call, latest submission per request wins) and
publishes bounds; :meth:`LengthService.latest` is a dictionary read. All public methods are
thread-safe, never block on the model, and can be called from asyncio code (no awaiting needed)
or from plain threads. :meth:`LengthService.observe` at finish drives the online calibrator, the
running-quantile fallback, the telemetry log and, when enough new telemetry exists, a background
refit of the forest that is swapped in atomically.

Why a thread and not a process pool: the compiled forest spends most of its time in numpy/Cython
code that releases the GIL, one prediction costs ~1 ms, and a thread shares the calibrator state
without IPC; the worker runs at most one batch at a time so it uses at most one of the cores.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jitflow_server.analyzer.length import LengthModelError, LengthPredictor, load_predictor_or_none
from jitflow_server.analyzer.length_calibration import (
    DEFAULT_QUANTILE,
    OnlineCalibrator,
    RunningQuantileFallback,
    finalize_bound,
)
from jitflow_server.analyzer.length_data import LengthExample, telemetry_record
from jitflow_server.analyzer.length_features import PREFIX_FEATURE_NAMES, prompt_features
from jitflow_server.analyzer.tokens import TokenCounter, get_token_counter

logger = logging.getLogger(__name__)


@dataclass
class _Req:
    prompt: str
    app: str | None
    model: str | None
    stage: str | None
    max_tokens: int | None
    kind: str | None = None
    response_format: str | None = None
    k: int = 0  # latest generated-token count seen
    last_model_k: int = -1  # k of the latest submission sent to the forest
    prompt_tokens: int | None = None
    prompt_feats: np.ndarray | None = None
    memory_feats: np.ndarray | None = None
    memory_of: str = ""  # version of the predictor whose memory computed memory_feats
    prefix_feats: dict[int, list[float]] = field(default_factory=dict)
    issued: list[tuple[int, float]] = field(default_factory=list)  # (k, served bound) from the model
    bound0: int | None = None


@dataclass
class _Job:
    req_id: str
    k: int
    generated_text: str


class LengthService:
    """Serve length upper bounds asynchronously (thread worker, batched forest calls).

    Args:
        predictor: a fitted :class:`LengthPredictor`, a path to a saved model (a missing/corrupt file
            logs a warning and the fallback is used), or ``None`` (fallback only).
        quantile: target coverage q of the bounds (default 0.9).
        refine_every: re-predict at most once per this many generated tokens (JITServe: 50).
        calibrate: apply :class:`OnlineCalibrator` (adaptive conformal inference per app/model).
        calibration_step: ACI step γ (log units).
        telemetry_path: JSONL file receiving one :func:`telemetry_record` per observed request
            (features only unless ``record_text``).
        record_text: also store prompt text in telemetry (off by default: no plaintext stored).
        refit_min_new: refit the forest in the background after this many new observations
            (``0`` disables refit). Needs a predictor.
        max_batch: most requests per forest call.
        default_tokens: the fallback's bound before anything was observed, for requests without
            ``max_tokens`` (default ``DEFAULT_FALLBACK_TOKENS``).
        counter: the :class:`TokenCounter` of the served model (prompt counts, telemetry); used to
            load ``predictor`` when it is a path. Default: the predictor's counter, else the process-wide
            :func:`get_token_counter`.
    """

    def __init__(self, predictor: LengthPredictor | str | os.PathLike[str] | None = None,
                 quantile: float = DEFAULT_QUANTILE, refine_every: int = 50, calibrate: bool = True, *,
                 calibration_step: float = 0.05, telemetry_path: str | os.PathLike[str] | None = None,
                 record_text: bool = False, refit_min_new: int = 2000, max_batch: int = 64,
                 default_tokens: int | None = None, counter: TokenCounter | None = None) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        if refine_every < 1:
            raise ValueError("refine_every must be >= 1")
        if isinstance(predictor, (str, os.PathLike)):
            predictor = load_predictor_or_none(predictor, counter=counter)
        if predictor is not None and not predictor.fitted:
            raise LengthModelError("LengthService needs a fitted predictor (or None for the fallback)")
        self.predictor: LengthPredictor | None = predictor
        self._counter = counter
        self.quantile = float(quantile)
        self.refine_every = int(refine_every)
        self.calibrate = bool(calibrate)
        self.calibrator = OnlineCalibrator(quantile, step=calibration_step)
        fb_kwargs = {"default_tokens": default_tokens} if default_tokens else {}
        self.fallback = RunningQuantileFallback(quantile, **fb_kwargs)
        self.telemetry_path = Path(telemetry_path).expanduser() if telemetry_path else None
        self.record_text = record_text
        self.refit_min_new = int(refit_min_new)
        self.max_batch = int(max_batch)
        self._reqs: dict[str, _Req] = {}
        self._bounds: dict[str, int] = {}
        self._queue: deque[_Job] = deque()
        self._late: deque[tuple[_Req, int]] = deque()  # finished before their prompt features existed
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._busy = False
        self._closed = False
        self._new_examples: list[LengthExample] = []
        self._refit_thread: threading.Thread | None = None
        self._tel_lock = threading.Lock()
        self.stats = {"submitted": 0, "predicted": 0, "batches": 0, "observed": 0, "refits": 0, "errors": 0}
        #: Called (on the worker thread, without arguments) after each batch of model bounds is published,
        #: so a consumer can push them at once instead of polling :meth:`latest`. Must not block.
        self.on_published: Any = None
        self._worker = threading.Thread(target=self._run, name="jitflow-length", daemon=True)
        self._worker.start()

    @classmethod
    def from_default_model(cls, counter: TokenCounter | None = None, **kwargs: Any) -> LengthService:
        """Service with the model at ``$JITFLOW_LENGTH_MODEL`` / ``~/.cache/jitflow/models/length-qrf.pkl``
        (fallback with a logged warning if it is missing or corrupt), counting tokens with ``counter``
        (the served model's; a warning is logged when the model was trained with another tokenizer).
        ``kwargs`` are the other :class:`LengthService` arguments."""
        return cls(load_predictor_or_none(None, counter=counter), counter=counter, **kwargs)

    @property
    def counter(self) -> TokenCounter:
        """The :class:`TokenCounter` of prompt counts and telemetry: the ``counter`` argument, else the
        predictor's, else the process-wide one (resolved on first use)."""
        if self._counter is None:
            self._counter = self.predictor.counter if self.predictor is not None else get_token_counter()
        return self._counter

    # -- context manager ------------------------------------------------------------------------------
    def __enter__(self) -> LengthService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> LengthService:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # -- scheduler-facing API -------------------------------------------------------------------------
    def submit(self, req_id: str, prompt: str, *, app: str | None = None, model: str | None = None,
               stage: str | None = None, max_tokens: int | None = None, generated_text: str = "",
               generated_tokens: int = 0, kind: str | None = None, response_format: str | None = None) -> None:
        """Queue a (re-)prediction for ``req_id`` and return at once (never runs the model).

        First call: at arrival (``generated_tokens=0``); later calls: with the generated text so far
        and its token count ``generated_tokens`` (the service re-predicts at most every
        ``refine_every`` tokens; in between it only lifts the bound to ``>= generated_tokens + 1``).
        Until the worker answers, :meth:`latest` returns the running-quantile fallback bound. ``kind``
        (the SLO kind) and ``response_format`` (OpenAI's ``response_format.type``) are features and
        calibration groups; only the first submission's values are used.
        Raises ``ValueError`` for negative token counts and ``RuntimeError`` after :meth:`close`.
        """
        if generated_tokens < 0:
            raise ValueError("generated_tokens must be >= 0")
        k = int(generated_tokens)
        with self._cv:
            if self._closed:
                raise RuntimeError("LengthService is closed")
            r = self._reqs.get(req_id)
            if r is None:
                r = _Req(prompt, app, model, stage, max_tokens, kind, response_format)
                self._reqs[req_id] = r
            r.k = max(r.k, k)
            cur = self._bounds.get(req_id)
            if cur is None:
                self._bounds[req_id] = self.fallback.bound(app, k, max_tokens)
            else:
                self._bounds[req_id] = finalize_bound(cur, r.k, r.max_tokens)
            self.stats["submitted"] += 1
            if r.last_model_k >= 0 and k < r.last_model_k + self.refine_every:
                return
            if self.predictor is None:
                self._bounds[req_id] = self.fallback.bound(app, k, max_tokens)
                r.last_model_k = k
                return
            r.last_model_k = k
            self._queue.append(_Job(req_id, k, generated_text))
            self._cv.notify()

    def latest(self, req_id: str) -> int | None:
        """Latest bound (total output tokens) for ``req_id``, or ``None`` if never submitted/already observed."""
        return self._bounds.get(req_id)

    def discard(self, req_id: str) -> None:
        """Forget ``req_id`` without learning from it (rejected, aborted or failed requests). Idempotent."""
        with self._cv:
            self._reqs.pop(req_id, None)
            self._bounds.pop(req_id, None)

    def observe(self, req_id: str, output_len: int) -> None:
        """Report the finished request's total output length (tokens).

        Updates the calibrator with every model bound this request was served, the per-app fallback,
        the telemetry log and the refit counter; forgets the request. Unknown ids are ignored.
        Never blocks on the model.
        """
        with self._cv:
            r = self._reqs.pop(req_id, None)
            self._bounds.pop(req_id, None)
            self.stats["observed"] += 1
        if r is None:
            return
        self.fallback.observe(r.app, output_len, truncated=r.max_tokens is not None and output_len >= r.max_tokens)
        self.calibrator.observe(r.app, r.model, r.issued, output_len, kind=r.kind)
        if r.prompt_feats is None:
            # no forest (cold start: the telemetry is what the first model is trained on) or the request
            # finished before the worker reached it: the worker computes the prompt features off this thread
            if self.telemetry_path is not None or self.predictor is not None:
                with self._cv:
                    self._late.append((r, int(output_len)))
                    self._cv.notify()
            return
        self._record(r, int(output_len))

    def _record(self, r: _Req, output_len: int) -> None:
        """Telemetry line and refit example for one finished request whose prompt features are known."""
        ex = LengthExample(output_len=int(output_len), prompt=r.prompt if self.record_text else None,
                           app=r.app, model=r.model, stage=r.stage, prompt_tokens=r.prompt_tokens,
                           prompt_features=[float(x) for x in r.prompt_feats],
                           prefix_features={k: v for k, v in r.prefix_feats.items() if k < output_len},
                           kind=r.kind, max_tokens=r.max_tokens, response_format=r.response_format,
                           memory_features=([float(x) for x in r.memory_feats] if r.memory_feats is not None
                                            else None))
        self._write_telemetry(r, ex)
        if self.predictor is not None and self.refit_min_new > 0:
            with self._lock:
                self._new_examples.append(ex)
                start = len(self._new_examples) >= self.refit_min_new and not self._refitting()
                batch = self._new_examples if start else None
                if start:
                    self._new_examples = []
            if batch:
                self._start_refit(batch)

    def _record_late(self, late: list[tuple[_Req, int]], predictor: LengthPredictor | None) -> None:
        """Featurize and record requests that finished before their prompt features existed."""
        if late:
            self._featurize([r for r, _ in late], predictor.counter if predictor else self.counter)
            for r, n in late:
                self._record(r, n)

    def flush(self, timeout: float = 10.0) -> bool:
        """Block until the queue is empty and the worker idle (tests/CLI only). True if drained in time."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._late or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    async def aflush(self, timeout: float = 10.0) -> bool:
        """Async :meth:`flush`: polls without blocking the event loop."""
        import asyncio

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queue and not self._busy:
                    return True
            await asyncio.sleep(0.002)
        return False

    def close(self) -> None:
        """Stop the worker (pending predictions are dropped; telemetry of finished requests is written)
        and wait for it and any refit to end."""
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify_all()
        self._worker.join(timeout=10)
        with self._cv:
            late = list(self._late)
            self._late.clear()
        self._record_late(late, self.predictor)
        if self._refit_thread is not None:
            self._refit_thread.join(timeout=120)

    # -- worker ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._late and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                late = list(self._late)
                self._late.clear()
                jobs: dict[str, _Job] = {}
                while self._queue and len(jobs) < self.max_batch:
                    j = self._queue.popleft()
                    jobs[j.req_id] = j  # latest submission per request wins
                reqs = {rid: self._reqs.get(rid) for rid in jobs}
                self._busy = True
                predictor = self.predictor
            try:
                self._record_late(late, predictor)
                live = [(j, reqs[j.req_id]) for j in jobs.values() if reqs[j.req_id] is not None]
                if live and predictor is not None:
                    self._predict_batch(predictor, live)
            except Exception:  # never kill the worker; the fallback bound stays in place
                self.stats["errors"] += 1
                logger.exception("length prediction failed; keeping the fallback bound")
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _predict_batch(self, predictor: LengthPredictor, live: list[tuple[_Job, _Req]]) -> None:
        self._featurize([r for _, r in live], predictor.counter)
        stale = [r for _, r in live if r.memory_of != predictor.version]
        if stale:
            for r, m in zip(stale, predictor.memory_features([r.prompt for r in stale]), strict=True):
                r.memory_feats, r.memory_of = m, predictor.version
        pf = np.stack([r.prompt_feats for _, r in live])
        mf = np.stack([r.memory_feats for _, r in live])
        ctx = [{"app": r.app, "kind": r.kind, "model": r.model, "stage": r.stage, "max_tokens": r.max_tokens,
                "response_format": r.response_format} for _, r in live]
        X, ks = predictor.features([r.prompt for _, r in live], [j.generated_text for j, _ in live], ctx,
                                   generated_tokens=[j.k for j, _ in live], prompt_feats=pf, memory_feats=mf)
        raw, spread = predictor.predict_bounds(X)
        n_prompt = pf.shape[1]
        n_pre = n_prompt + len(PREFIX_FEATURE_NAMES)
        with self._cv:
            for (j, r), x, rb, sp in zip(live, X, raw, spread, strict=True):
                factor = (self.calibrator.factor(r.app, r.model, j.k, kind=r.kind, spread=float(sp))
                          if self.calibrate else 1.0)
                b = finalize_bound(float(rb) * factor, max(j.k, r.k), r.max_tokens)
                r.issued.append((j.k, float(b)))
                if j.k == 0:
                    r.bound0 = b
                else:
                    r.prefix_feats[j.k] = [float(v) for v in x[n_prompt:n_pre]]
                if self._reqs.get(j.req_id) is r:
                    self._bounds[j.req_id] = b
            self.stats["predicted"] += len(live)
            self.stats["batches"] += 1
        if self.on_published is not None:
            try:
                self.on_published()
            except Exception:  # a consumer's bug must not stop the predictor
                logger.exception("on_published callback failed")

    @staticmethod
    def _featurize(reqs: list[_Req], counter: TokenCounter) -> None:
        """Fill ``prompt_tokens`` and ``prompt_feats`` of the requests that lack them (worker thread)."""
        need = [r for r in reqs if r.prompt_feats is None]
        if need:
            toks = counter.count([r.prompt for r in need])
            feats = prompt_features([r.prompt for r in need], toks)
            for r, t, f in zip(need, toks, feats, strict=True):
                r.prompt_tokens, r.prompt_feats = t, f

    # -- telemetry and refit --------------------------------------------------------------------------
    def _write_telemetry(self, r: _Req, ex: LengthExample) -> None:
        if self.telemetry_path is None:
            return
        rec = telemetry_record(output_len=ex.output_len, prompt=ex.prompt, prompt_tokens=r.prompt_tokens,
                               prompt_feats=ex.prompt_features, prefix_feats=ex.prefix_features, app=r.app,
                               model=r.model, stage=r.stage, max_tokens=r.max_tokens, bound0=r.bound0,
                               kind=r.kind, response_format=r.response_format, memory_feats=ex.memory_features,
                               tokenizer=(self.predictor.counter.name if self.predictor else self.counter.name))
        line = json.dumps(rec, separators=(",", ":")) + "\n"
        with self._tel_lock:
            self.telemetry_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.telemetry_path, "a", encoding="utf-8") as fh:
                fh.write(line)

    def _refitting(self) -> bool:
        return self._refit_thread is not None and self._refit_thread.is_alive()

    def _start_refit(self, batch: list[LengthExample]) -> None:
        def work() -> None:
            old = self.predictor
            if old is None:
                return
            t0 = time.perf_counter()
            try:
                new = old.refit(batch, keep_previous=True)
            except Exception:
                logger.exception("background refit of the length model failed; keeping %s", old.version)
                return
            with self._cv:
                self.predictor = new
                self.stats["refits"] += 1
            logger.info("length model refit on %d new requests in %.1fs: %s -> %s", len(batch),
                        time.perf_counter() - t0, old.version, new.version)

        self._refit_thread = threading.Thread(target=work, name="jitflow-length-refit", daemon=True)
        self._refit_thread.start()

    def refit_now(self, timeout: float | None = None) -> bool:
        """Start a refit on the pending new observations (if any) and wait for it. True if a refit ran."""
        with self._lock:
            batch, self._new_examples = self._new_examples, []
        if not batch or self.predictor is None:
            return False
        before = self.stats["refits"]
        self._start_refit(batch)
        if self._refit_thread is not None:
            self._refit_thread.join(timeout)
        return self.stats["refits"] > before
