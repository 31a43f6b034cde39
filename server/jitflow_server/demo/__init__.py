"""``jitflow demo``: the main job as a real mixed-workload run.

Starts ``jitflow serve`` (demo model, GMAX, ``patterns/*.jsonl`` as initial pattern history) as a
subprocess in its own process group, waits for ``/health``, then for a bounded time drives one
open-loop load of the three SLO kinds of JITServe §3 against it:

* ``chat`` -- streaming chat users with a latency SLO (TTFT, TBT);
* ``deadline`` -- non-streamed requests with an end-to-end deadline;
* ``compound`` -- concurrent deep-research and Tree-of-Thoughts tasks (``examples/``) with task
  deadlines, which the server splits into per-stage sub-deadlines (JITServe §4.1).

With ``--data DIR`` chat/deadline prompts are AlpacaEval instructions (``DIR/alpaca_eval/*.json``,
``max_tokens`` from the reference answer's length) and arrivals come from the Azure LLM inference
trace (``DIR/azure_llm_2023/*conv.csv``) rescaled to the target rate, keeping its burstiness;
otherwise a built-in prompt set and Poisson arrivals are used. The report gives per kind the SLO
attainment and goodput (tokens, JITServe §3), per task its stages with sub-deadlines (from
``GET /v1/tasks/{id}``) and outcome; it is written as JSON and a PNG. ``--compare fcfs`` replays
the same load (same prompts, arrival times, tasks) on the same server after switching the policy
(``POST /v1/jitflow/policy``) and prints the goodput ratio (the second run's pattern history also
holds the first run's tasks). The server is always stopped (process-group kill).
"""

from __future__ import annotations

from jitflow_server.demo.cli import register, run_demo
from jitflow_server.demo.plan import (
    DemoConfig,
    DemoError,
    LoadItem,
    Plan,
    azure_arrivals,
    build_plan,
    load_alpaca,
)
from jitflow_server.demo.report import plot_report
from jitflow_server.demo.results import ReqRecord, summarize_run

__all__ = [
    "DemoConfig",
    "LoadItem",
    "Plan",
    "ReqRecord",
    "DemoError",
    "build_plan",
    "azure_arrivals",
    "load_alpaca",
    "summarize_run",
    "plot_report",
    "run_demo",
    "register",
]
