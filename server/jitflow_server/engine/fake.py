"""A deterministic stand-in for the vLLM engine: the seam for unit tests of the API and the task manager.

:class:`FakeEngine` implements :class:`~jitflow_server.engine.protocol.Engine` without a model. Each
*step* admits waiting requests first-come first-served up to ``batch_size`` and gives every running
request one token; a request ends after ``max_tokens`` tokens with ``ignore_eos``, otherwise after
``min(max_tokens, eos_after)``. Token ids and texts are fixed (token ``i`` of every request is
``100 + i % 50``, text ``" t{i}"``), so two runs of the same requests give the same output. With
``step_s`` set, a background task (owned by the engine, cancelled by ``shutdown``) steps every
``step_s`` seconds while requests are unfinished; with ``step_s=None`` the test calls :meth:`step`.
Admission control (``reject_waiting``), ``abort``, pause/resume and hint updates behave like the
real plug-in's; everything the API sent is kept in :attr:`requests` and :attr:`updates` for checks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jitflow_server.engine.protocol import GenerateRequest, InvalidRequestError, PolicySpec, TokenDelta
from jitflow_server.scheduler.admission import ServiceRate
from jitflow_server.scheduler.hints import HintUpdate


@dataclass
class _FakeRequest:
    request: GenerateRequest
    length: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: int = 0
    scheduled: bool = False
    done: bool = False


class FakeEngine:
    """Deterministic engine (see the module docstring). Sizes in tokens, times in seconds."""

    def __init__(self, served_name: str = "fake", *, max_model_len: int = 2048, vocab_size: int = 512,
                 batch_size: int = 4, eos_after: int = 16, step_s: float | None = 0.002) -> None:
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.dtype: str | None = "float32"
        self._vocab = vocab_size
        self.batch_size = batch_size
        self.eos_after = eos_after
        self.step_s = step_s
        self.policy = "fcfs"
        self.started = False
        self.paused = False
        self.steps_run = 0
        self.requests: dict[str, GenerateRequest] = {}
        self.updates: list[HintUpdate] = []
        self._waiting: list[_FakeRequest] = []
        self._running: list[_FakeRequest] = []
        self._events: list[list[Any]] = []
        self._stepper: asyncio.Task | None = None
        self.rejected = 0

    # ----------------------------------------------------------------------------- lifecycle
    @property
    def alive(self) -> bool:
        """True between ``start`` and ``shutdown``."""
        return self.started

    @property
    def vocab_size(self) -> int:
        """Valid prompt token ids are ``[0, vocab_size)``."""
        return self._vocab

    def start(self) -> None:
        """Mark the engine started (nothing to load)."""
        self.started = True

    def shutdown(self) -> None:
        """Cancel the stepping task and end every unfinished request as aborted."""
        if self._stepper is not None:
            self._stepper.cancel()
            self._stepper = None
        for r in self._waiting + self._running:
            self._finish(r, "abort")
        self.started = False

    # ----------------------------------------------------------------------------- tokenizer
    def encode(self, text: str) -> list[int]:
        """One token per UTF-8 byte (ids 3..258, folded into the vocabulary)."""
        return [3 + b % (self._vocab - 3) for b in text.encode()]

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """``role: content`` lines, then ``assistant:``, encoded with :meth:`encode`."""
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")

    # ----------------------------------------------------------------------------- requests
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Queue ``request``; raises :class:`InvalidRequestError` for ``max_tokens < 1`` or a duplicate id."""
        if not self.started:
            raise InvalidRequestError("engine not started")
        if request.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", "max_tokens")
        if request.request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id}")
        self.requests[request.request_id] = request
        length = request.max_tokens if request.ignore_eos else min(request.max_tokens, self.eos_after)
        r = _FakeRequest(request, length)
        self._waiting.append(r)
        self._event("add", request.request_id, request.hints.kind.value)
        if self.step_s is not None and (self._stepper is None or self._stepper.done()):
            self._stepper = asyncio.get_running_loop().create_task(self._auto_step(), name="fake-engine-steps")
        return self._stream(r)

    @staticmethod
    async def _stream(r: _FakeRequest) -> AsyncIterator[TokenDelta]:
        while True:
            delta = await r.queue.get()
            yield delta
            if delta.finished:
                return

    async def _auto_step(self) -> None:
        while self._waiting or self._running:
            await asyncio.sleep(self.step_s or 0.0)
            await self.step()

    async def step(self) -> int:
        """Run one engine step; returns how many requests got a token (0 while paused)."""
        if self.paused:
            return 0
        while self._waiting and len(self._running) < self.batch_size:
            r = self._waiting.pop(0)
            r.scheduled = True
            self._running.append(r)
            self._event("first_sched", r.request.request_id)
        for r in list(self._running):
            i = r.generated
            r.generated += 1
            fin = r.generated >= r.length
            r.queue.put_nowait(TokenDelta([100 + i % 50], f" t{i}", fin,
                                          ("length" if r.length == r.request.max_tokens else "stop")
                                          if fin else None))
            if fin:
                self._running.remove(r)
                r.done = True
                self._event("finish", r.request.request_id, f"out={r.generated}")
        self.steps_run += 1
        return len(self._running)

    def _finish(self, r: _FakeRequest, reason: str) -> None:
        if r.done:
            return
        r.done = True
        if r in self._waiting:
            self._waiting.remove(r)
        if r in self._running:
            self._running.remove(r)
        r.queue.put_nowait(TokenDelta([], "", True, reason))
        self._event("finish", r.request.request_id, reason)

    def _find(self, request_id: str) -> _FakeRequest | None:
        return next((r for r in self._waiting + self._running if r.request.request_id == request_id), None)

    async def abort(self, request_id: str) -> None:
        """End a request as aborted (idempotent)."""
        r = self._find(request_id)
        if r is not None:
            self._finish(r, "abort")

    async def reject_waiting(self, request_ids: Sequence[str]) -> list[str]:
        """Remove requests never scheduled (admission control); returns the ids removed."""
        out = []
        for rid in request_ids:
            r = self._find(rid)
            if r is not None and not r.scheduled:
                self._event("reject", rid, "admission")
                self._finish(r, "abort")
                self.rejected += 1
                out.append(rid)
        return out

    async def update_hints(self, update: HintUpdate) -> None:
        """Record ``update`` (see :attr:`updates`)."""
        self.updates.append(update)

    async def set_policy(self, spec: PolicySpec) -> dict[str, Any]:
        """Switch the (nominal) policy; raises ``ValueError`` for ``oracle`` like the real plug-in."""
        if spec.name == "oracle":
            raise ValueError("policy 'oracle' reads true output lengths, which exist only in the simulator")
        self.policy = spec.name
        if spec.batch_size is not None:
            self.batch_size = spec.batch_size
        return await self.stats()

    # ----------------------------------------------------------------------------- diagnostics
    def _event(self, kind: str, rid: str, detail: str = "") -> None:
        self._events.append([time.time(), kind, rid, detail])

    async def stats(self) -> dict[str, Any]:
        """Counters shaped like the plug-in's (a subset)."""
        return {"policy": self.policy, "params": {}, "batch_size": self.batch_size,
                "running": len(self._running), "waiting": len(self._waiting), "paused": self.paused,
                "unfinished": len(self._running) + len(self._waiting), "steps": self.steps_run,
                "rejected": self.rejected, "service": self._service_rate()}

    def _service_rate(self) -> dict | None:
        """Every step takes ``step_s`` whatever the batch (``None`` when stepped by hand)."""
        if not self.step_s:
            return None
        return ServiceRate(base_s=self.step_s, per_decode_s=0.0, per_prefill_token_s=0.0, wall_factor=1.0,
                           min_step_s=self.step_s, batch_size=self.batch_size,
                           decode_batch=self.batch_size).to_dict()

    async def events(self) -> list[list[Any]]:
        """Lifecycle events ``[unix s, event, request id, detail]``."""
        return [list(e) for e in self._events[-256:]]

    async def plan(self) -> dict[str, Any]:
        """The fake has no policy frames: always ``{}``."""
        return {}

    async def steps(self, since: float) -> list[list[Any]]:
        """The fake keeps no step log: always ``[]``."""
        return []

    async def pause(self) -> None:
        """Stop stepping (requests keep their state)."""
        self.paused = True

    async def resume(self) -> None:
        """Resume stepping."""
        self.paused = False

    async def is_paused(self) -> bool:
        """True between ``pause`` and ``resume``."""
        return self.paused

    def num_unfinished_frontend(self) -> int:
        """Requests not yet finished."""
        return len(self._running) + len(self._waiting)
