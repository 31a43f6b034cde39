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

    label = f"{run.policy}, {run.phase} phase" if run.phase else f"policy {run.policy}"
    t = Table(title=f"SLO attainment and goodput per kind ({label})")
    for c in ("kind", "n", "met", "attainment", "goodput tok", "goodput tok/s", "rejected", "err/unfin.",
              "P50 TTFT", "P95 TTFT", "P50 TBT", "P50 E2EL", "P95 E2EL"):
        t.add_column(c, justify="left" if c == "kind" else "right")
    for kind in (*KINDS, "all"):
        s = run.summary[kind]
        att = s["attainment"]
        t.add_row(kind, str(s["n"]), str(s["met"]), "-" if att is None else f"{100 * att:.0f}%",
                  str(s["goodput_tokens"]), _fmt(s["goodput_tok_s"], ".1f"), str(s.get("rejected", "")),
                  f"{s.get('errors', 0)}/{s.get('unfinished', 0)}" if kind != "all" else "",
                  _fmt(s.get("p50_ttft"), ".2f", "s"), _fmt(s.get("p95_ttft"), ".2f", "s"),
                  _fmt(s.get("p50_tbt"), ".3f", "s"), _fmt(s.get("p50_e2el"), ".1f", "s"), _fmt(s.get("p95_e2el"), ".1f", "s"))
    console.print(t)
    tt = Table(title=f"compound tasks ({label}): stages as name end/sub-deadline (s from start)")
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


# ---------------------------------------------------------------------- the comparison
#: Targets the report checks (JSON ``targets``): burst-phase token goodput ratio and normal-phase attainment.
BURST_TOKEN_TARGET = 1.3
NORMAL_ATTAINMENT_TARGET = 0.9


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def compare_phase(main: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """Side-by-side numbers of one phase from two ``summarize_run`` results (``base`` may be None);
    :func:`build_report` adds ``token_goodput_ceiling`` and ``met_output_share`` ([main, base]).

    Returns ``{"token_goodput_ratio", "request_goodput_ratio", "compound_met": [main, base],
    "compound_n", "attainment": {kind: [main, base]}}`` (ratios main / base, None without a baseline or
    when the baseline's value is 0)."""
    kinds = (*KINDS, "all")
    return {
        "token_goodput_ratio": _ratio(main["all"]["goodput_tokens"], base["all"]["goodput_tokens"]) if base else None,
        "request_goodput_ratio": _ratio(main["all"]["met"], base["all"]["met"]) if base else None,
        "compound_met": [main["compound"]["met"], base["compound"]["met"] if base else None],
        "compound_n": main["compound"]["n"],
        "attainment": {k: [main[k]["attainment"], base[k]["attainment"] if base else None] for k in kinds},
    }


def unit_tokens(rec: dict[str, Any]) -> int:
    """Goodput tokens a request record earns when it meets its SLO: a chat's output tokens, a deadline
    request's prompt and output tokens (the server's goodput definition, ``tracker/goodput.py``)."""
    out = rec.get("output_tokens") or 0
    return out if rec.get("kind") == "chat" else (rec.get("prompt_tokens") or 0) + out


def token_ceiling(main: RunResult, base: RunResult) -> float | None:
    """The token goodput ratio a scheduler would reach against ``base`` if every request and task of the
    phase met its SLO: Σ over units of the most tokens either side's run shows for it (a refused request
    shows none on that side), over ``base``'s goodput tokens. None when the runs do not pair up or
    ``base`` earned nothing. When the baseline already meets the SLOs that carry most of the tokens (the
    agent tasks), no schedule can reach a large ratio: this number says how large."""
    if len(main.records) != len(base.records) or len(main.tasks) != len(base.tasks):
        return None
    total = sum(max(unit_tokens(a), unit_tokens(b)) for a, b in
                zip((asdict(r) for r in main.records), (asdict(r) for r in base.records), strict=True))
    total += sum(max(a.get("tokens") or 0, b.get("tokens") or 0) for a, b in zip(main.tasks, base.tasks, strict=True))
    return _ratio(total, base.summary["all"]["goodput_tokens"])


def met_output_share(run: RunResult) -> float | None:
    """The share of the output tokens the engine generated during ``run`` that went to requests and tasks
    meeting their SLO (``summary["all"]["met_output_tokens"] / generated_output_tokens``, capped at 1); the rest was
    spent on calls that missed, were abandoned by their clients or refused after starting. None when the
    server's counter could not be read or nothing was generated. An overloaded scheduler without
    admission control keeps the engine as busy as one with it, on work that no longer counts: this is
    where that shows."""
    gen = run.generated_output_tokens
    if not gen:
        return None
    return min(1.0, run.summary["all"]["met_output_tokens"] / gen)


def check_targets(comparison: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """The demo's targets from the per-phase comparison (None where a phase or the baseline is missing):
    burst token goodput ≥ 1.3× the baseline's and more compound tasks met; normal-phase attainment ≥ 0.9
    for every kind and not below the baseline's for any kind."""
    burst, normal = comparison.get("burst"), comparison.get("normal")
    out: dict[str, bool | None] = {"burst_token_goodput_ratio_ge_1_3": None, "burst_more_compound_met": None,
                                   "normal_attainment_ge_0_9_every_kind": None,
                                   "normal_attainment_not_below_baseline": None}
    if burst and burst["token_goodput_ratio"] is not None:
        out["burst_token_goodput_ratio_ge_1_3"] = burst["token_goodput_ratio"] >= BURST_TOKEN_TARGET
    if burst and burst["compound_met"][1] is not None:
        out["burst_more_compound_met"] = burst["compound_met"][0] > burst["compound_met"][1]
    if normal:
        att = normal["attainment"]
        out["normal_attainment_ge_0_9_every_kind"] = all(
            (att[k][0] or 0) >= NORMAL_ATTAINMENT_TARGET for k in KINDS if att[k][0] is not None)
        if all(att[k][1] is not None for k in KINDS if att[k][0] is not None):
            out["normal_attainment_not_below_baseline"] = all(
                (att[k][0] or 0) >= (att[k][1] or 0) for k in KINDS if att[k][0] is not None)
    return out


def run_dict(run: RunResult) -> dict[str, Any]:
    """A run as JSON: side label, phase, wall time, summary, the output tokens the engine generated and the
    share of them that met an SLO, per-request records, per-task reports."""
    return {"side": run.policy, "phase": run.phase, "wall": run.wall, "summary": run.summary,
            "generated_output_tokens": run.generated_output_tokens, "met_output_share": met_output_share(run),
            "records": [asdict(r) for r in run.records], "tasks": run.tasks}


def build_report(opts: Any, cap: Any, phases: list[Any], sides: list[Any], runs: list[RunResult], length: Any,
                 served: dict[str, Any], version: int) -> dict[str, Any]:
    """The report dict (schema in docs/quickstart.md) from the demo's parts."""
    main_label = sides[-1].label
    base_label = sides[0].label if len(sides) > 1 else None
    by = {(r.policy, r.phase): r for r in runs}
    comparison = {}
    for ph in phases:
        main_run, base_run = by.get((main_label, ph.name)), by.get((base_label, ph.name))
        if main_run is None:
            continue
        comparison[ph.name] = compare_phase(main_run.summary, base_run.summary if base_run else None)
        comparison[ph.name]["token_goodput_ceiling"] = token_ceiling(main_run, base_run) if base_run else None
        comparison[ph.name]["met_output_share"] = [met_output_share(main_run),
                                                   met_output_share(base_run) if base_run else None]
    main_served = served.get(main_label) or {}
    used = "qrf" if main_served.get("model") else "fallback"
    warning = None if used == "qrf" else (
        f"the {main_label} server did not load the trained length model ({length.path}); it used the running "
        "per-application quantiles instead")
    slos = phases[0].cfg if phases else opts.slos  # as run: scaled to the machine (demo/main.py)
    return {
        "version": version, "model": opts.model, "data": str(opts.data_dir) if opts.data_dir else None,
        "seed": opts.seed, "wall_s": None,
        "capacity": {k: v for k, v in vars(cap).items()},
        "phases": [{"name": ph.name, "load_x_capacity": ph.load, "scale": ph.scale, "duration_s": ph.cfg.duration,
                    "chat_rate": ph.cfg.chat_rate, "deadline_rate": ph.cfg.deadline_rate,
                    "research_tasks": ph.cfg.research_tasks, "tot_tasks": ph.cfg.tot_tasks,
                    "prompt_source": ph.plan.prompt_source, "arrival_source": ph.plan.arrival_source,
                    "counts": ph.plan.counts()} for ph in phases],
        "slos": {"ttft_s": slos.ttft, "tbt_s": slos.tbt, "deadline_s": slos.deadline,
                 "research_deadline_s": slos.research_deadline, "tot_deadline_s": slos.tot_deadline,
                 "waiting_time_s": slos.waiting_time},
        "sides": [{"label": s.label, "scheduler": s.scheduler, "policy": s.policy} for s in sides],
        "baseline": base_label, "main": main_label,
        "length_predictor": {"used": used, "path": str(length.path), "source": length.source_kind,
                             "sources": [str(p) for p in length.sources], "trained_this_run": length.trained,
                             "served": served, "warning": warning},
        "comparison": comparison,
        "targets": check_targets(comparison),
        "failed_tasks": sum(r.summary["all"]["failed_tasks"] for r in runs),
        "runs": [run_dict(r) for r in runs],
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _x(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}×"


def comparison_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per (phase, side): the numbers of the comparison table (also the markdown table)."""
    rows = []
    for run in report["runs"]:
        s = run["summary"]
        rows.append([run["phase"], run["side"], _pct(s["chat"]["attainment"]), _pct(s["deadline"]["attainment"]),
                     f"{s['compound']['met']}/{s['compound']['n']}", _pct(s["all"]["attainment"]),
                     f"{s['all']['goodput_tok_s']:.0f}", f"{s['all']['goodput_req_s']:.2f}", str(s["all"]["rejected"]),
                     _fmt(run.get("generated_output_tokens"), "d"), _pct(run.get("met_output_share")),
                     _fmt(s["chat"]["p50_ttft"], ".2f", "s"), _fmt(s["chat"]["p95_ttft"], ".2f", "s"),
                     _fmt(s["chat"]["p50_tbt"], ".3f", "s"), _fmt(s["chat"]["p95_tbt"], ".3f", "s"),
                     _fmt(s["deadline"]["p50_e2el"], ".1f", "s"), _fmt(s["deadline"]["p95_e2el"], ".1f", "s")])
    return rows


#: ``output tokens``: all the engine generated in the run; ``in SLO``: the share of them that met an SLO.
COMPARISON_COLUMNS = ("phase", "scheduler", "chat att.", "deadline att.", "compound met", "all att.",
                      "goodput tok/s", "goodput req/s", "rejected", "output tokens", "in SLO", "P50 TTFT", "P95 TTFT",
                      "P50 TBT", "P95 TBT", "P50 E2EL (deadline)", "P95 E2EL (deadline)")


def print_comparison(report: dict[str, Any], console: Any) -> None:
    """The side-by-side table, the highlighted ratios, the targets and the length-predictor line."""
    from rich.table import Table

    t = Table(title="jitflow demo: both schedulers on the same arrivals")
    for c in COMPARISON_COLUMNS:
        t.add_column(c, justify="left" if c in ("phase", "scheduler") else "right")
    for row in comparison_rows(report):
        t.add_row(*row)
    console.print(t)
    base, main = report["baseline"], report["main"]
    for phase, c in report["comparison"].items():
        if base is None:
            break
        console.print(f"[bold]{phase} phase: {main} / {base} token goodput [reverse] {_x(c['token_goodput_ratio'])} "
                      f"[/reverse] (every SLO met would be {_x(c.get('token_goodput_ceiling'))}), requests meeting "
                      f"their SLO {_x(c['request_goodput_ratio'])}, compound tasks met "
                      f"{c['compound_met'][0]} vs {c['compound_met'][1]} of {c['compound_n']}[/bold]; output "
                      f"tokens that met an SLO {_pct(c['met_output_share'][0])} vs {_pct(c['met_output_share'][1])}")
    for name, ok in report["targets"].items():
        if ok is not None:
            console.print(f"  target {name}: {'[green]met[/green]' if ok else '[red]missed[/red]'}")
    lp = report["length_predictor"]
    if lp["warning"]:
        console.print(f"[bold yellow]warning:[/bold yellow] {lp['warning']}")
    else:
        ver = (lp["served"].get(main) or {}).get("version")
        console.print(f"length predictor: trained QRF {ver} ({lp['source']}, "
                      f"{'trained in this run' if lp['trained_this_run'] else 'cached'})")
    if report["failed_tasks"]:
        console.print(f"[red]{report['failed_tasks']} agent task(s) failed with an error[/red]")
    for key in ("speed_warning", "capacity_warning"):
        if report.get(key):
            console.print(f"[bold yellow]warning:[/bold yellow] {report[key]}")


def write_markdown(report: dict[str, Any], path: Path) -> None:
    """``demo-report.md``: capacity, phases, the comparison table, ratios, targets, length predictor, the
    analyzer's call-time model."""
    cap = report["capacity"]
    lines = ["# jitflow demo report", "",
             f"Model `{report['model']}`; capacity {cap['out_tok_s']:.0f} output tok/s on the demo mix "
             f"({'cached' if cap.get('cached') else 'measured'} {cap['measured_at']}); "
             f"baseline `{report['baseline']}`, jitflow `{report['main']}`; wall {report['wall_s']:.0f} s.", "",
             "| phase | × capacity | chat/s | deadline/s | deep-research | tree-of-thoughts |", "|---|---:|---:|---:|---:|---:|"]
    for ph in report["phases"]:
        lines.append(f"| {ph['name']} | {ph['load_x_capacity']:.1f} | {ph['chat_rate']:.2f} | {ph['deadline_rate']:.2f} "
                     f"| {ph['research_tasks']} | {ph['tot_tasks']} |")
    lines += ["", "| " + " | ".join(COMPARISON_COLUMNS) + " |", "|" + "---|" * len(COMPARISON_COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in comparison_rows(report)]
    lines.append("")
    for phase, c in report["comparison"].items():
        if report["baseline"] is not None:
            lines.append(f"- **{phase}**: token goodput ratio **{_x(c['token_goodput_ratio'])}** (every SLO met: "
                         f"{_x(c.get('token_goodput_ceiling'))}), request goodput "
                         f"ratio {_x(c['request_goodput_ratio'])}, compound tasks met {c['compound_met'][0]} vs "
                         f"{c['compound_met'][1]} of {c['compound_n']}, output tokens that met an SLO "
                         f"{_pct(c['met_output_share'][0])} vs {_pct(c['met_output_share'][1])}")
    lines += ["", "Targets: " + ", ".join(f"{k} {'met' if v else 'missed'}" for k, v in report["targets"].items()
                                          if v is not None), ""]
    lp = report["length_predictor"]
    lines.append(f"Length predictor: {lp['used']} ({lp['source']}, {lp['path']})" +
                 (f". **Warning**: {lp['warning']}" if lp["warning"] else ""))
    for side, tm in (report.get("analyzer_time_model") or {}).items():
        lines.append(f"Analyzer call-time model ({side}): {tm['decode_s_per_token'] * 1e3:.0f} ms per decoded token, "
                     f"{tm['prefill_s_per_token'] * 1e3:.2f} ms per prompt token ({tm['source']})")
    lines.append(f"Failed tasks: {report['failed_tasks']}")
    lines += [f"**Warning**: {report[key]}" for key in ("speed_warning", "capacity_warning") if report.get(key)]
    path.write_text("\n".join(lines) + "\n")
