"""jitflow: client SDK for SLO-aware LLM serving of agent workflows (JITServe, NSDI'26).

Plain calls::

    import jitflow
    async with jitflow.AsyncClient(base_url="http://127.0.0.1:8000") as client:
        r = await client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}],
            slo=jitflow.Latency(ttft=2, tbt=0.1),
        )
        print(r.content, r.jitflow.ttft, r.jitflow.slo_met)

Compound tasks (one deadline for a staged DAG of LLM and tool calls)::

    @jitflow.agent(app="deep-research", deadline=60)
    async def research(q: str) -> str:
        async with jitflow.stage("plan") as st:
            plan = await st.chat([{"role": "user", "content": q}], max_tokens=128)
        ...

See ``docs/sdk.md`` for the guide and the wire reference.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import _exceptions
from ._agent import agent, configure, get_client, tool
from ._calls import CallRecord
from ._client import DEFAULT_BASE_URL, DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT, AsyncClient, Client
from ._context import current_stage, current_task
from ._exceptions import *  # noqa: F403 - every public exception (its __all__)
from ._slo import SLO, BestEffort, Compound, Deadline, Latency, parse_slo
from ._streaming import AsyncStream, Stream
from ._task import Stage, StageScope, Task, TaskScope, stage
from ._telemetry import TelemetryStats, TelemetryWarning
from ._types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    Choice,
    ChoiceDelta,
    ChunkChoice,
    Completion,
    CompletionChoice,
    Model,
    ModelList,
    Response,
    ResponseStreamEvent,
    ResponseUsage,
    Timing,
    Usage,
)

__all__ = [
    "__version__",
    # clients
    "AsyncClient",
    "Client",
    "DEFAULT_BASE_URL",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT",
    "AsyncStream",
    "Stream",
    # SLOs
    "SLO",
    "Latency",
    "Deadline",
    "Compound",
    "BestEffort",
    "parse_slo",
    # responses
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionMessage",
    "Choice",
    "ChoiceDelta",
    "ChunkChoice",
    "Completion",
    "CompletionChoice",
    "Model",
    "ModelList",
    "Response",
    "ResponseStreamEvent",
    "ResponseUsage",
    "Timing",
    "Usage",
    # compound tasks
    "agent",
    "tool",
    "stage",
    "configure",
    "get_client",
    "current_task",
    "current_stage",
    "Task",
    "TaskScope",
    "Stage",
    "StageScope",
    "CallRecord",
    "TelemetryStats",
    "TelemetryWarning",
    # errors: every public exception
    *_exceptions.__all__,
]
