"""A staged compound task on the public SDK: sub-deadlines from a matched pattern, and one trace.

Runs the same 3-stage task twice against a running ``jitflow serve`` (the second run matches the
first in the server's pattern history), prints ``GET /v1/tasks/{id}`` (stages, sub-deadlines,
matched pattern, outcome) and the OpenTelemetry span tree of the run (workflow -> stage ->
chat / execute_tool, with GenAI attributes). Only the public SDK (plus the OpenTelemetry SDK,
which the *application* configures) is used.

    python -m examples.staged_task --server http://127.0.0.1:8000 [--model demo] [--deadline 30]
"""

from __future__ import annotations

import argparse
import json

import anyio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import jitflow


async def run_once(client: jitflow.AsyncClient, deadline: float) -> str:
    """One task: plan -> 3 parallel research calls + a tool -> answer. Returns the task id."""

    @jitflow.tool(name="lookup")
    async def lookup(topic: str) -> str:
        await anyio.sleep(0.05)
        return topic[::-1]

    @jitflow.agent(app="staged-example", deadline=deadline, client=client)
    async def agent(question: str) -> str:
        async with jitflow.stage("plan") as st:
            await st.chat([{"role": "user", "content": question}], max_tokens=24)
        async with jitflow.stage("research") as st:
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(lambda i=i: st.chat([{"role": "user", "content": f"aspect {i}"}], max_tokens=32))
            await lookup(question)
        async with jitflow.stage("answer") as st:
            await st.chat([{"role": "user", "content": "answer"}], max_tokens=48)
        return jitflow.current_task().task_id

    return await agent("How do schedulers meet deadlines?")


def print_tree(spans) -> None:
    """Print spans as an indented tree (name, kind, key attributes)."""
    by_parent: dict = {}
    for s in spans:
        by_parent.setdefault(s.parent.span_id if s.parent else None, []).append(s)

    def walk(parent, depth):
        for s in sorted(by_parent.get(parent, []), key=lambda x: x.start_time):
            keys = ("gen_ai.operation.name", "gen_ai.request.model", "gen_ai.usage.output_tokens",
                    "gen_ai.tool.name", "jitflow.stage", "jitflow.sub_deadline", "jitflow.slo_met")
            attrs = {k: s.attributes[k] for k in keys if k in s.attributes}
            print(f"{'  ' * depth}{s.name} [{s.kind.name}] trace={s.context.trace_id:032x} {attrs}")
            walk(s.context.span_id, depth + 1)

    walk(None, 0)


async def main(server: str, model: str | None, deadline: float) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with jitflow.AsyncClient(base_url=server, model=model, tracer_provider=provider) as client:
        await run_once(client, deadline)  # history for the next run
        exporter.clear()
        task_id = await run_once(client, deadline)
        view = await client.get_task(task_id)
    print(json.dumps({k: view[k] for k in ("task_id", "outcome", "start_time", "deadline", "matched")}, indent=2))
    for s in view["stages"]:
        print(f"stage {s['index']} {s['name']:<9} sub-deadline T0+{s['sub_deadline'] - view['start_time']:6.2f} s "
              f"calls={len(s['calls'])}")
    print_tree(exporter.get_finished_spans())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None)
    ap.add_argument("--deadline", type=float, default=30.0)
    a = ap.parse_args()
    anyio.run(main, a.server, a.model, a.deadline)
