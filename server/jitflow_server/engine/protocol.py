"""The engine contract the API is written against: plain data in, token deltas out.

The API never imports vLLM. It hands an :class:`Engine` one :class:`GenerateRequest` per LLM call
(prompt token ids, sampling settings and the request's :class:`~jitflow_server.scheduler.hints.SchedHints`)
and reads :class:`TokenDelta` values back. Control calls (stats, refined hints, admission rejection,
policy switch) are typed methods. Two implementations exist: :class:`~jitflow_server.engine.vllm_engine.VLLMEngine`
(the real engine with the scheduler plug-in) and :class:`~jitflow_server.engine.fake.FakeEngine` (a
deterministic stand-in for unit tests of the API and the task manager).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from jitflow_server.scheduler.hints import HintUpdate, SchedHints


class EngineError(RuntimeError):
    """The engine failed to start, died, or failed while serving a request."""


class UpstreamError(EngineError):
    """A remote replica (``engine/remote.py``) could not serve the request; the message is meant for the
    client. ``status``: the HTTP status the API answers with (502 when a replica failed after tokens were
    streamed, 503 when no replica answers, a replica's own 4xx when it refused the request);
    ``retry_after``: seconds to suggest in ``Retry-After`` (``None``: no header)."""

    def __init__(self, message: str, status: int = 502, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class InvalidRequestError(ValueError):
    """The engine cannot run this request as given (e.g. bad sampling settings); ``field`` names the
    request field at fault (``None`` if unknown). The API answers it with HTTP 400."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Constrained decoding: ``json_object`` (any JSON object) or a JSON ``schema``."""

    json_object: bool = False
    schema: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One LLM call for the engine.

    ``prompt_token_ids``: the prompt (token ids); ``max_tokens``: output cap (tokens); sampling settings
    as in OpenAI's API; ``ignore_eos`` generates exactly ``max_tokens`` tokens; ``min_tokens`` suppresses
    EOS before that many; ``hints`` what the scheduler knows (its ``request_id`` is this request's id);
    ``trace_headers`` W3C ``traceparent``/``tracestate`` to propagate.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    hints: SchedHints
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    structured: StructuredOutput | None = None
    trace_headers: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New output of one request since the previous delta: ``token_ids``, their ``text``, and whether the
    request ``finished`` (then ``finish_reason``: ``stop``, ``length`` or ``abort``)."""

    token_ids: Sequence[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A scheduling policy switch: ``name`` (see ``scheduler.POLICY_NAMES``), its ``params`` and the batch
    size ``batch_size`` B (``None``: unchanged)."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    batch_size: int | None = None


class EngineCall(str, Enum):
    """The control calls the scheduler plug-in answers in the engine process (see ``engine/plugin.py``)."""

    STATS = "stats"
    EVENTS = "events"
    PLAN = "plan"
    STEPS = "steps"
    UPDATE = "update"
    REJECT_WAITING = "reject_waiting"
    SET_POLICY = "set_policy"


@runtime_checkable
class Engine(Protocol):
    """What the API needs from an engine. Times are unix seconds; lengths tokens.

    ``generate`` validates the request at once (raising :class:`InvalidRequestError`) and returns the
    stream of its deltas; abandoning the stream does not stop the request: call ``abort``.
    ``reject_waiting`` removes requests that were never scheduled (admission control, JITServe §5) and
    returns the ids it removed. ``stats``/``events``/``plan``/``steps`` are diagnostics (JSON-ready).
    """

    served_name: str
    max_model_len: int
    dtype: str | None

    @property
    def alive(self) -> bool: ...

    @property
    def vocab_size(self) -> int: ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    async def reject_waiting(self, request_ids: Sequence[str]) -> list[str]: ...

    async def update_hints(self, update: HintUpdate) -> None: ...

    async def set_policy(self, spec: PolicySpec) -> dict[str, Any]: ...

    async def stats(self) -> dict[str, Any]: ...

    async def events(self) -> list[list[Any]]: ...

    async def plan(self) -> dict[str, Any]: ...

    async def steps(self, since: float) -> list[list[Any]]: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def is_paused(self) -> bool: ...

    def num_unfinished_frontend(self) -> int: ...
