"""Matplotlib (Agg) figures of ``jitflow bench sim`` results (JITServe Figs. 13-17, 19-21 analogues)."""

from __future__ import annotations

from pathlib import Path

BASELINES = ("fcfs", "sarathi", "edf", "sjf", "las")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _rps_keys(res: dict) -> list[str]:
    return sorted(res["main"], key=float)


def plot_goodput_vs_rps(res: dict, out: Path) -> Path:
    """Token and request goodput vs RPS per policy (Fig. 15), with 95 % error bars for several seeds."""
    plt = _plt()
    keys = _rps_keys(res)
    xs = [float(k) for k in keys]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for pol in res["config"]["policies"]:
        for ax, m in zip(axes, ("token_goodput", "request_goodput"), strict=True):
            runs = [res["main"][k][pol] for k in keys]
            err = [r.get(f"{m}_ci95") or 0.0 for r in runs]  # 95 % interval with --seeds > 1
            ax.errorbar(xs, [r[m] for r in runs], yerr=err if any(err) else None, marker="o", capsize=3,
                        label=pol)
    axes[0].set_ylabel("token goodput (tokens/s)")
    axes[1].set_ylabel("request goodput (requests/s meeting SLO)")
    for ax in axes:
        ax.set_xlabel("offered load (requests/s)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Goodput vs load ({res['config']['preset']})")
    fig.tight_layout()
    p = out / "goodput_vs_rps.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def plot_oracle(res: dict, out: Path) -> Path | None:
    """GMAX vs oracle token goodput per RPS (Fig. 13)."""
    pols = res["config"]["policies"]
    if "gmax" not in pols or "oracle" not in pols:
        return None
    plt = _plt()
    keys = _rps_keys(res)
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(keys))
    g = [res["main"][k]["gmax"]["token_goodput"] for k in keys]
    o = [res["main"][k]["oracle"]["token_goodput"] for k in keys]
    ax.bar([x - 0.2 for x in xs], o, 0.4, label="oracle (JITServe*)")
    ax.bar([x + 0.2 for x in xs], g, 0.4, label="gmax")
    for x, a, b in zip(xs, g, o, strict=True):
        ax.text(x + 0.2, a, f"{a / b:.0%}" if b else "", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), keys)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("token goodput (tokens/s)")
    ax.legend()
    fig.tight_layout()
    p = out / "oracle.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def plot_throughput(res: dict, out: Path) -> Path:
    """Throughput per policy and RPS (Fig. 14)."""
    plt = _plt()
    keys = _rps_keys(res)
    pols = res["config"]["policies"]
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / len(pols)
    for i, pol in enumerate(pols):
        ax.bar([x + i * w for x in range(len(keys))], [res["main"][k][pol]["throughput"] for k in keys], w, label=pol)
    ax.set_xticks([x + w * (len(pols) - 1) / 2 for x in range(len(keys))], keys)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("throughput (output tokens/s)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    p = out / "throughput.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def plot_latency(res: dict, out: Path, rps_key: str) -> Path:
    """P50/P95 TTFT, TBT (latency kind), E2EL (deadline, compound) per policy at one load (Fig. 16)."""
    plt = _plt()
    pols = res["config"]["policies"]
    runs = res["main"][rps_key]
    panels = [("latency", "ttft", "TTFT, latency kind (s)"), ("latency", "tbt", "TBT, latency kind (s)"),
              ("deadline", "e2el", "E2EL, deadline kind (s)"), ("compound", "e2el", "E2EL, compound kind (s)")]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    for ax, (kind, met, title) in zip(axes, panels, strict=True):
        p50 = [(runs[p]["per_kind"].get(kind, {}).get(f"{met}_p50") or 0.0) for p in pols]
        p95 = [(runs[p]["per_kind"].get(kind, {}).get(f"{met}_p95") or 0.0) for p in pols]
        xs = range(len(pols))
        ax.bar([x - 0.2 for x in xs], p50, 0.4, label="P50")
        ax.bar([x + 0.2 for x in xs], p95, 0.4, label="P95")
        ax.set_yscale("log")
        ax.set_xticks(list(xs), pols, rotation=45, fontsize=8)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Latency per kind at {rps_key} requests/s (served requests only)")
    fig.tight_layout()
    p = out / "latency_per_kind.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def plot_bars(rows: dict[str, float], out: Path, name: str, title: str, ylabel: str) -> Path:
    """A simple bar chart ``{label: value}`` (ablation, Fig. 17)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = list(rows)
    ax.bar(range(len(labels)), [rows[k] for k in labels], color="tab:blue")
    ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    p = out / name
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def plot_sweep(sweep: dict, out: Path, name: str, title: str, xlabel: str, categorical: bool = False) -> Path:
    """Token goodput per policy across a sweep ``{x: {policy: metrics}}`` (Figs. 19/21 and 20)."""
    plt = _plt()
    keys = list(sweep)
    pols = list(next(iter(sweep.values())))
    fig, ax = plt.subplots(figsize=(8, 4))
    if categorical:
        w = 0.8 / len(pols)
        for i, pol in enumerate(pols):
            ax.bar([x + i * w for x in range(len(keys))], [sweep[k][pol]["token_goodput"] for k in keys], w, label=pol)
        ax.set_xticks([x + w * (len(pols) - 1) / 2 for x in range(len(keys))], keys)
    else:
        xs = [float(k) for k in keys]
        for pol in pols:
            ax.plot(xs, [sweep[k][pol]["token_goodput"] for k in keys], marker="o", label=pol)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("token goodput (tokens/s)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / name
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
