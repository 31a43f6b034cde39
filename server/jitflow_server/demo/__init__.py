"""``jitflow demo``: the main job, GMAX against stock vLLM on the real engine.

The demo measures this machine's engine capacity on its mixed load (cached per machine and model),
trains or reuses the QRF length model, then runs a *normal* phase (0.7× capacity) and a *burst* phase
(1.5×) twice on the same arrivals and prompts: once under stock vLLM scheduling (no jitflow plug-in,
no admission control, the analyzer's hints ignored) and once under jitflow's GMAX with the analyzer.
The load mixes the three SLO kinds of JITServe §3:

* ``chat`` -- streaming chat users with a latency SLO (TTFT, TBT);
* ``deadline`` -- non-streamed requests with an end-to-end deadline;
* ``compound`` -- concurrent deep-research and Tree-of-Thoughts tasks (``examples/``) with task
  deadlines, which the server splits into per-stage sub-deadlines (JITServe §4.1).

With ``--data DIR`` chat/deadline prompts are AlpacaEval instructions and arrivals come from the Azure
LLM inference trace rescaled to each phase's rate; otherwise built-in prompts and Poisson arrivals.
Reports: ``demo-report.json`` (schema in docs/quickstart.md), ``.md`` and ``.png``.
"""

from __future__ import annotations

from jitflow_server.demo.cli import register
from jitflow_server.demo.main import DemoOptions, Side, run_demo
from jitflow_server.demo.plan import (
    BASE_MIX,
    BaseMix,
    DemoConfig,
    DemoError,
    LoadItem,
    Plan,
    azure_arrivals,
    build_plan,
    load_alpaca,
    phase_config,
)
from jitflow_server.demo.report_plot import plot_report
from jitflow_server.demo.results import ReqRecord, summarize_run

__all__ = [
    "BASE_MIX",
    "BaseMix",
    "DemoConfig",
    "DemoOptions",
    "Side",
    "LoadItem",
    "Plan",
    "ReqRecord",
    "DemoError",
    "build_plan",
    "phase_config",
    "azure_arrivals",
    "load_alpaca",
    "summarize_run",
    "plot_report",
    "run_demo",
    "register",
]
