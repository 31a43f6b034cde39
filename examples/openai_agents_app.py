"""Two OpenAI Agents SDK agents served by jitflow with no change to the agents: the workflow is one
compound task with an end-to-end deadline, each model turn one stage.

The only jitflow piece is :class:`jitflow.integrations.openai_agents.AgentTask`: its ``hooks`` and
``run_config()`` go to each ``Runner.run`` of the workflow. Workflow: a ``planner`` agent drafts a plan,
a ``writer`` agent answers from it. Needs ``pip install openai-agents``.

    python -m examples.openai_agents_app "Why is the sky blue?" --server http://127.0.0.1:8000 [--deadline 60]

Prints the answer and the server's view of the task (``GET /v1/tasks/{id}``: stages, sub-deadlines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid

import httpx


async def run(server: str, question: str, deadline: float, model: str | None = None,
              task_id: str | None = None, max_tokens: int = 32) -> tuple[str, str]:
    """Run the workflow once as one jitflow task; returns ``(answer, task id)``."""
    from agents import Agent, ModelSettings, Runner

    from jitflow.integrations.openai_agents import AgentTask

    base = server.rstrip("/") + "/v1"
    if model is None:
        model = httpx.get(base + "/models").json()["data"][0]["id"]
    task = AgentTask("agents-example", deadline, base_url=base, task_id=task_id or uuid.uuid4().hex)
    # Responses API's least max_output_tokens is 16
    settings = ModelSettings(max_tokens=max(max_tokens, 16))
    planner = Agent(name="planner", instructions="Plan how to answer the question.", model=model,
                    model_settings=settings)
    writer = Agent(name="writer", instructions="Answer the question from the plan.", model=model,
                   model_settings=settings)
    # the SDK exports its own traces to OpenAI unless told not to; jitflow's come from the server
    config = task.run_config(tracing_disabled=True)
    plan = await Runner.run(planner, question, hooks=task.hooks, run_config=config)
    answer = await Runner.run(writer, f"Question: {question}\nPlan: {plan.final_output}", hooks=task.hooks,
                              run_config=config)
    return str(answer.final_output), task.task_id


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("question")
    ap.add_argument("--server", default="http://127.0.0.1:8000")
    ap.add_argument("--deadline", type=float, default=60.0)
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    answer, task_id = asyncio.run(run(args.server, args.question, args.deadline, args.model))
    print("answer:", answer)
    print(json.dumps(httpx.get(f"{args.server.rstrip('/')}/v1/tasks/{task_id}").json(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
