"""OpenAI Agents SDK: one jitflow compound task per workflow, one stage per model turn.

The agents stay as they are; a workflow's runs get the task's hooks and run config::

    from agents import Agent, Runner
    from jitflow.integrations import openai_agents as jf

    task = jf.AgentTask("trip-planner", deadline=60, base_url="http://127.0.0.1:8000/v1")
    plan = await Runner.run(planner, question, hooks=task.hooks, run_config=task.run_config())
    answer = await Runner.run(writer, plan.final_output, hooks=task.hooks, run_config=task.run_config())

Every model call of those runs goes through the task's OpenAI client (Responses API by default), whose
HTTP client adds the task's ``x-jitflow-*`` headers (docs/api.md): the task id and application, the stage
(the name of the agent taking the turn) and its index (the task's model turns counted from 0, across
runs, tool calls and handoffs), kind ``compound`` and the time left to the deadline. The server registers
the task at its first call, gives every stage a sub-deadline from the application's history and closes
the task once its calls are over. The turn is counted by the run hooks (``on_llm_start``), so runs of one
task go one after another; a workflow that runs agents in parallel gives each branch its own task.

Needs ``openai-agents`` (``pip install openai-agents``); importing this module does not.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx

from jitflow.integrations._transport import (
    AsyncHeaderTransport,
    check_task,
    client_kwargs,
    task_context_headers,
)

__all__ = ["AgentTask"]


class AgentTask:
    """One compound task of application ``app``, due ``deadline`` seconds from now, served by the jitflow
    server at ``base_url`` (its ``/v1`` URL).

    Raises:
        ValueError: ``deadline`` not a positive number of seconds, or an empty ``app``.
    """

    def __init__(self, app: str, deadline: float, *, base_url: str, api_key: str = "unused",
                 task_id: str | None = None) -> None:
        check_task(app, deadline)
        self.app = app
        self.task_id = task_id or uuid.uuid4().hex
        #: the task's absolute deadline (unix s)
        self.deadline_at = time.time() + float(deadline)
        self.base_url = base_url
        self.api_key = api_key
        #: model turns so far; the next turn is stage ``turns``
        self.turns = 0
        self._stage: str | None = None
        self._hooks: Any = None

    def headers(self) -> dict[str, str]:
        """The ``x-jitflow-*`` headers of the turn running now (stage 0 before the first turn)."""
        return task_context_headers(self.task_id, self.app, self.deadline_at, self._stage, max(self.turns - 1, 0))

    def _turn(self, agent_name: str) -> None:
        self._stage = agent_name
        self.turns += 1

    @property
    def hooks(self) -> Any:
        """The ``agents.RunHooks`` that count this task's model turns (pass to every ``Runner.run``)."""
        if self._hooks is None:
            from agents import RunHooks

            task = self

            class _TaskHooks(RunHooks):
                async def on_llm_start(self, context, agent, system_prompt, input_items) -> None:
                    task._turn(agent.name)

            self._hooks = _TaskHooks()
        return self._hooks

    def http_client(self, **kwargs: Any) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` adding this task's headers to every request (``kwargs`` go to it)."""
        return httpx.AsyncClient(transport=AsyncHeaderTransport(self.headers), **client_kwargs(kwargs))

    def openai_client(self) -> Any:
        """An ``openai.AsyncOpenAI`` for ``base_url`` that sends through :meth:`http_client`."""
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, http_client=self.http_client())

    def run_config(self, *, use_responses: bool = True, **kwargs: Any) -> Any:
        """An ``agents.RunConfig`` whose model provider uses :meth:`openai_client` (the Responses API, or
        Chat Completions with ``use_responses=False``); ``kwargs`` go to ``RunConfig``."""
        from agents import OpenAIProvider, RunConfig

        provider = OpenAIProvider(openai_client=self.openai_client(), use_responses=use_responses)
        return RunConfig(model_provider=provider, **kwargs)
