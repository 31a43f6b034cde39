"""The demo's report: the per-kind table, the per-task stage table and the PNG plot."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from jitflow_server.demo.plan import KINDS
from jitflow_server.demo.results import RunResult


# ---------------------------------------------------------------------- reporting
def _fmt(x: Any, spec: str = ".2f", unit: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:{spec}}{unit}"


def print_summary(run: RunResult, console: Any) -> None:
    """Rich tables: per-kind SLO attainment and goodput; per task its stages and outcome."""
    from rich.table import Table

    t = Table(title=f"SLO attainment and goodput per kind (policy {run.policy})")
    for c in ("kind", "n", "met", "attainment", "goodput tok", "goodput tok/s", "rejected", "err/unfin.",
              "P50 TTFT", "P95 TTFT", "P50 E2EL", "P95 E2EL"):
        t.add_column(c, justify="left" if c == "kind" else "right")
    for kind in (*KINDS, "all"):
        s = run.summary[kind]
        att = s["attainment"]
        t.add_row(kind, str(s["n"]), str(s["met"]), "-" if att is None else f"{100 * att:.0f}%",
                  str(s["goodput_tokens"]), _fmt(s["goodput_tok_s"], ".1f"), str(s.get("rejected", "")),
                  f"{s.get('errors', 0)}/{s.get('unfinished', 0)}" if kind != "all" else "",
                  _fmt(s.get("p50_ttft"), ".2f", "s"), _fmt(s.get("p95_ttft"), ".2f", "s"),
                  _fmt(s.get("p50_e2el"), ".1f", "s"), _fmt(s.get("p95_e2el"), ".1f", "s"))
    console.print(t)
    tt = Table(title=f"compound tasks (policy {run.policy}): stages as name end/sub-deadline (s from start)")
    for c in ("start", "app", "task", "deadline", "elapsed", "outcome", "matched", "stages"):
        tt.add_column(c, justify="right" if c in ("start", "deadline", "elapsed") else "left", overflow="fold")
    for task in sorted(run.tasks, key=lambda x: x.get("t", 0)):
        stages = []
        for s in task.get("stages") or []:
            end, sd = s.get("end"), s.get("sub_deadline")
            mark = "" if s.get("met_sub_deadline") is None else ("✓" if s["met_sub_deadline"] else "✗")
            stages.append(f"{s['name']} {_fmt(end, '.1f')}/{_fmt(sd, '.1f')}{mark}")
        colour = {"succeeded": "green", "deadline_missed": "yellow"}.get(task.get("outcome"), "red")
        matched = (task.get("server_view") or {}).get("matched")
        tt.add_row(_fmt(task.get("t"), ".0f"), task.get("app", ""), (task.get("task_id") or "")[:8],
                   _fmt(task.get("deadline"), ".0f"), _fmt(task.get("elapsed"), ".1f"),
                   f"[{colour}]{task.get('outcome')}[/{colour}]", "yes" if matched else "no", "; ".join(stages))
    console.print(tt)


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Write the demo's figure: per-kind SLO attainment and goodput (one bar per policy run), the
    compound tasks' stage timelines with sub-deadlines and deadlines, and the chat TTFT CDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax_att, ax_gp, ax_tl, ax_cdf = axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        xs = [k + i * width for k in range(len(KINDS))]
        att = [100 * (run["summary"][k]["attainment"] or 0) for k in KINDS]
        gp = [run["summary"][k]["goodput_tok_s"] for k in KINDS]
        ax_att.bar(xs, att, width, label=run["policy"])
        ax_gp.bar(xs, gp, width, label=run["policy"])
    for ax, title, ylabel in ((ax_att, "SLO attainment per kind", "% of requests / tasks meeting SLO"),
                              (ax_gp, "goodput per kind", "goodput (tokens/s)")):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(KINDS))])
        ax.set_xticklabels(KINDS)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend()
    ax_att.set_ylim(0, 105)
    # Task timelines of the first run.
    tasks = sorted(runs[0]["tasks"], key=lambda x: x.get("t", 0)) if runs else []
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names: dict[str, str] = {}
    for row, task in enumerate(tasks):
        t0 = task.get("t", 0.0)
        for s in task.get("stages") or []:
            if s.get("end") is None:
                continue
            c = names.setdefault(s["name"], colours[len(names) % len(colours)])
            ax_tl.barh(row, s["end"] - s["start"], left=t0 + s["start"], color=c, height=0.6,
                       label=s["name"] if list(names).index(s["name"]) == len(names) - 1 and
                       not any(s["name"] == lab for lab in ax_tl.get_legend_handles_labels()[1]) else None)
            if s.get("sub_deadline") is not None:
                ax_tl.plot([t0 + s["sub_deadline"]] * 2, [row - 0.38, row + 0.38], color="black", lw=0.9)
        if task.get("deadline"):
            ok = task.get("outcome") == "succeeded"
            ax_tl.plot(t0 + task["deadline"], row, marker="|", ms=14, mew=2.5, color="green" if ok else "red")
    ax_tl.set_yticks(range(len(tasks)))
    short = {"deep-research": "DR", "tree-of-thoughts": "ToT"}
    verdict = {"succeeded": "met", "deadline_missed": "missed"}
    ax_tl.set_yticklabels([f"{short.get(t.get('app', ''), t.get('app', ''))} {verdict.get(t.get('outcome'), t.get('outcome'))}"
                           for t in tasks], fontsize=7)
    ax_tl.set_xlabel("time since load start (s)")
    ax_tl.set_title(f"compound tasks ({runs[0]['policy'] if runs else ''}): stages, sub-deadlines (black ticks), "
                    "deadline (green: met, red: missed)", fontsize=9)
    if names:
        ax_tl.legend(fontsize=7, loc="lower right")
    for run in runs:
        ttfts = sorted(r["ttft"] for r in run["records"] if r["kind"] == "chat" and r.get("ttft") is not None)
        if ttfts:
            ax_cdf.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=run["policy"])
    ttft_slo = report.get("config", {}).get("ttft")
    if ttft_slo:
        ax_cdf.axvline(ttft_slo, color="grey", ls="--", label="TTFT SLO")
    ax_cdf.set_xlabel("chat TTFT (s)")
    ax_cdf.set_ylabel("CDF")
    ax_cdf.set_title("streaming chat: time to first token")
    ax_cdf.legend()
    fig.suptitle(f"jitflow demo: model {report.get('model')}, {report.get('plan', {}).get('counts')}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _run_dict(run: RunResult) -> dict[str, Any]:
    return {"policy": run.policy, "wall": run.wall, "summary": run.summary,
            "records": [asdict(r) for r in run.records], "tasks": run.tasks}
