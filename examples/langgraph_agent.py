"""A LangGraph agent served by jitflow with no change to its nodes: the graph run is one compound task with
an end-to-end deadline, each super-step one stage.

The nodes call the model with the plain ``openai`` client; the only jitflow pieces are the HTTP client
handed to it (:func:`jitflow.integrations.langgraph.http_client`) and the run config of the invocation
(:func:`~jitflow.integrations.langgraph.task_config`). Graph: ``plan`` -> ``research_a`` and
``research_b`` in parallel (one super-step) -> ``answer``. Needs ``pip install 'jitflow[langgraph]' openai``.

    python -m examples.langgraph_agent "Why is the sky blue?" --server http://127.0.0.1:8000 [--deadline 60]

Prints the answer and the server's view of the task (``GET /v1/tasks/{id}``: stages, sub-deadlines).
"""

from __future__ import annotations

import argparse
import json
import operator
import uuid
from typing import Annotated, Any, TypedDict

import httpx


class State(TypedDict):
    question: str
    notes: Annotated[list[str], operator.add]
    answer: str


def build_graph(llm: Any, model: str, max_tokens: int = 32):
    """The compiled graph; ``llm`` is an ``openai.OpenAI`` client (any OpenAI-compatible client works)."""
    from langgraph.graph import END, START, StateGraph

    def ask(prompt: str) -> str:
        r = llm.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                        max_tokens=max_tokens)
        return r.choices[0].message.content or ""

    def plan(state: State) -> dict:
        return {"notes": [ask(f"Plan how to answer: {state['question']}")]}

    def research_a(state: State) -> dict:
        return {"notes": [ask(f"Facts about: {state['question']}")]}

    def research_b(state: State) -> dict:
        return {"notes": [ask(f"Counterpoints about: {state['question']}")]}

    def answer(state: State) -> dict:
        return {"answer": ask("Answer using: " + " | ".join(state["notes"]))}

    g = StateGraph(State)
    for name, fn in (("plan", plan), ("research_a", research_a), ("research_b", research_b), ("answer", answer)):
        g.add_node(name, fn)
    g.add_edge(START, "plan")
    g.add_edge("plan", "research_a")
    g.add_edge("plan", "research_b")
    g.add_edge(["research_a", "research_b"], "answer")
    g.add_edge("answer", END)
    return g.compile()


def run(server: str, question: str, deadline: float, model: str | None = None,
        task_id: str | None = None) -> tuple[dict, str]:
    """Run the graph once as one jitflow task; returns ``(final state, task id)``."""
    import openai

    from jitflow.integrations import langgraph as jf

    llm = openai.OpenAI(base_url=server.rstrip("/") + "/v1", api_key="unused", http_client=jf.http_client())
    model = model or llm.models.list().data[0].id
    task_id = task_id or uuid.uuid4().hex
    graph = build_graph(llm, model)
    state = graph.invoke({"question": question, "notes": [], "answer": ""},
                         config=jf.task_config("langgraph-example", deadline, task_id=task_id))
    return state, task_id


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("question")
    ap.add_argument("--server", default="http://127.0.0.1:8000")
    ap.add_argument("--deadline", type=float, default=60.0)
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    state, task_id = run(args.server, args.question, args.deadline, args.model)
    print("answer:", state["answer"])
    print(json.dumps(httpx.get(f"{args.server.rstrip('/')}/v1/tasks/{task_id}").json(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
