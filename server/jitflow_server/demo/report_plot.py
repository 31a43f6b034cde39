"""``demo-report.png``: SLO attainment and goodput per kind with both schedulers side by side for each phase,
the offered load over time against the measured capacity, and the chat TTFT distribution."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jitflow_server.demo.plan import KINDS


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Write the demo's figure for a report dict (``build_report``'s output) to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    sides = [s["label"] for s in report["sides"]]
    phases = [p["name"] for p in report["phases"]]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    ax_att, ax_gp, ax_load, ax_cdf = axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]
    groups = [(ph, k) for ph in phases for k in KINDS]
    width = 0.8 / max(1, len(sides))
    by = {(r["side"], r["phase"]): r for r in runs}
    for i, side in enumerate(sides):
        xs = [g + i * width for g in range(len(groups))]
        att = [100 * ((by.get((side, ph)) or {}).get("summary", {}).get(k, {}).get("attainment") or 0) for ph, k in groups]
        gp = [(by.get((side, ph)) or {}).get("summary", {}).get(k, {}).get("goodput_tok_s") or 0 for ph, k in groups]
        ax_att.bar(xs, att, width, label=side)
        ax_gp.bar(xs, gp, width, label=side)
    for ax, title, ylabel in ((ax_att, "SLO attainment per kind and phase", "% of requests / tasks meeting SLO"),
                              (ax_gp, "token goodput per kind and phase", "goodput (tokens/s)")):
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{ph}\n{k}" for ph, k in groups], fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend()
    ax_att.set_ylim(0, 105)
    # Offered load: arrivals per 5 s of the first side's records and tasks, phases back to back.
    offset, bin_s = 0.0, 5.0
    for ph in report["phases"]:
        run = by.get((sides[0], ph["name"]))
        if run is None:
            continue
        times = [r["t"] for r in run["records"]] + [t.get("t", 0.0) for t in run["tasks"]]
        n_bins = max(1, int(ph["duration_s"] // bin_s))
        counts = [0] * n_bins
        for t in times:
            counts[min(n_bins - 1, int(t // bin_s))] += 1
        ax_load.step([offset + b * bin_s for b in range(n_bins)], [c / bin_s for c in counts], where="post",
                     label=f"{ph['name']} ({ph['load_x_capacity']:.1f}× capacity)")
        ax_load.axvline(offset, color="grey", lw=0.6, ls=":")
        offset += ph["duration_s"]
    ax_load.set_xlabel("load time (s), phases back to back")
    ax_load.set_ylabel("arrivals per second (requests + tasks)")
    ax_load.set_title(f"offered load; capacity {report['capacity']['out_tok_s']:.0f} output tok/s on this machine")
    ax_load.legend(fontsize=8)
    for run in runs:
        ttfts = sorted(r["ttft"] for r in run["records"] if r["kind"] == "chat" and r.get("ttft") is not None)
        if ttfts:
            ax_cdf.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))],
                        label=f"{run['side']} · {run['phase']}", ls="-" if run["phase"] == phases[0] else "--")
    ttft_slo = (report.get("slos") or {}).get("ttft_s")
    if ttft_slo:
        ax_cdf.axvline(ttft_slo, color="grey", ls=":", label="TTFT SLO")
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("chat TTFT (s), served requests")
    ax_cdf.set_ylabel("CDF")
    ax_cdf.set_title("streaming chat: time to first token")
    ax_cdf.legend(fontsize=8)
    fig.suptitle(f"jitflow demo: model {report.get('model')}, {' vs '.join(sides)} on the same arrivals", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
