"""``jitflow demo`` end to end against the session's real server (tiny model): a short mixed load
under GMAX, replayed under FCFS, with the JSON report and the plot."""

from __future__ import annotations

import json

import httpx
import pytest
from rich.console import Console

from jitflow_server.demo import DemoConfig, build_plan, run_demo

pytestmark = pytest.mark.engine


def test_demo_short_run_with_compare(server_url, policy, tmp_path):
    cfg = DemoConfig(duration=4, chat_rate=1.0, deadline_rate=0.5, research_tasks=1, tot_tasks=1,
                     research_deadline=60, tot_deadline=60, chat_tokens=(8, 24), deadline_tokens=(8, 24),
                     grace=40, seed=1)
    out = tmp_path / "demo.json"
    console = Console(file=open(tmp_path / "console.txt", "w"), width=160)  # noqa: SIM115
    report = run_demo(cfg, compare="fcfs", out=out, server_url=server_url, console=console)
    console.file.close()
    on_disk = json.loads(out.read_text())
    assert on_disk["compare"]["policies"] == ["gmax", "fcfs"]
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
    plan = build_plan(cfg)
    counts = plan.counts()
    assert [r["policy"] for r in report["runs"]] == ["gmax", "fcfs"]
    for run in report["runs"]:
        s = run["summary"]
        assert s["chat"]["n"] == counts.get("chat", 0) and s["deadline"]["n"] == counts.get("deadline", 0)
        assert s["compound"]["n"] == 2
        assert all(r["status"] == "ok" for r in run["records"]), run["records"]
        apps = sorted(t["app"] for t in run["tasks"])
        assert apps == ["deep-research", "tree-of-thoughts"]
        for t in run["tasks"]:
            assert t["outcome"] == "succeeded", t.get("error")
            assert t["server_view"] is not None and len(t["stages"]) >= 4
            assert s["compound"]["goodput_tokens"] >= t["tokens"] > 0
        assert s["all"]["goodput_tokens"] == sum(s[k]["goodput_tokens"] for k in ("chat", "deadline", "compound"))
    ratio = report["compare"]["goodput_ratio"]["all"]
    a, b = (r["summary"]["all"]["goodput_tokens"] for r in report["runs"])
    assert ratio == pytest.approx(a / b)
    text = (tmp_path / "console.txt").read_text()
    assert "SLO attainment and goodput per kind" in text and "goodput ratio gmax/fcfs" in text
    # The demo restored the server's policy.
    assert httpx.get(server_url + "/v1/jitflow/engine", timeout=10).json()["policy"] == "gmax"
