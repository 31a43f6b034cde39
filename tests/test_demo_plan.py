"""``jitflow demo`` without a server: the load plan (built-in, synthetic traces, real traces when
present), per-kind goodput summaries, and CLI errors."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jitflow_server.cli import app as cli_app
from jitflow_server.demo import (
    DemoConfig,
    DemoError,
    ReqRecord,
    azure_arrivals,
    build_plan,
    load_alpaca,
    summarize_run,
)
from jitflow_server.demo.plan import TASK_START_SHARE


def _write_azure(path: Path, gaps: list[float]) -> None:
    from datetime import datetime, timedelta

    t = datetime(2023, 11, 16, 18, 15, 46)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for g in [0.0, *gaps]:
        t += timedelta(seconds=g)
        lines.append(f"{t:%Y-%m-%d %H:%M:%S.%f}0,100,20")  # the trace's 7 fractional digits
    path.write_text("\n".join(lines) + "\n")


def _fake_data(root: Path, n_rows: int = 200) -> Path:
    (root / "alpaca_eval").mkdir(parents=True)
    (root / "azure_llm_2023").mkdir()
    recs = [{"instruction": f"Instruction number {i}?", "output": " ".join(["word"] * (10 * i + 5))}
            for i in range(30)]
    recs.append({"instruction": "Instruction number 1?", "output": "short"})  # duplicate, longer one kept
    (root / "alpaca_eval" / "model.json").write_text(json.dumps(recs))
    rng = random.Random(5)
    _write_azure(root / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv",
                 [rng.choice([0.01, 0.02, 0.5]) for _ in range(n_rows)])
    return root


def test_builtin_plan_is_deterministic_and_shaped_by_the_config():
    cfg = DemoConfig(duration=100, chat_rate=0.4, deadline_rate=0.2, research_tasks=5, tot_tasks=7, seed=3)
    p1, p2 = build_plan(cfg), build_plan(cfg)
    assert [(j.t, j.kind, j.prompt, j.max_tokens) for j in p1.jobs] == [(j.t, j.kind, j.prompt, j.max_tokens)
                                                                       for j in p2.jobs]
    cfg4 = DemoConfig(**{**cfg.__dict__, "seed": 4})
    assert [j.t for j in build_plan(cfg4).jobs] != [j.t for j in p1.jobs]
    c = p1.counts()
    assert c["research"] == 5 and c["tot"] == 7
    assert 0 < c["chat"] + c["deadline"] <= round(0.6 * 100)
    assert p1.prompt_source == "builtin" and p1.arrival_source == "poisson"
    assert all(0 <= j.t < cfg.duration for j in p1.jobs)
    assert [j.t for j in p1.jobs] == sorted(j.t for j in p1.jobs)
    for j in p1.jobs:
        if j.kind == "chat":
            assert cfg.chat_tokens[0] <= j.max_tokens <= cfg.chat_tokens[1] and j.deadline is None
        elif j.kind == "deadline":
            assert cfg.deadline_tokens[0] <= j.max_tokens <= cfg.deadline_tokens[1] and j.deadline == cfg.deadline
        elif j.kind == "research":
            assert j.t <= max(cfg.duration - cfg.research_deadline, TASK_START_SHARE * cfg.duration) and j.prompt
        else:
            assert len(j.numbers) == 4 and j.deadline == cfg.tot_deadline
    with pytest.raises(ValueError, match="duration"):
        build_plan(DemoConfig(duration=0))
    with pytest.raises(ValueError, match="chat_tokens"):
        build_plan(DemoConfig(chat_tokens=(10, 5)))


def test_azure_arrivals_are_rescaled_to_the_target_rate_keeping_burstiness(tmp_path):
    gaps = [0.1, 0.1, 2.0, 0.1, 0.5, 0.1, 3.0, 0.1]
    path = tmp_path / "conv.csv"
    _write_azure(path, gaps)
    ts = azure_arrivals(path, 8, rate=2.0, rng=random.Random(0))  # the whole trace: start index 0
    assert ts[0] == 0.0 and len(ts) == 8
    span = sum(gaps)
    scale = (8 / 2.0) / span
    assert ts == pytest.approx([sum(gaps[:i]) * scale for i in range(8)], rel=1e-6)
    with pytest.raises(DemoError):
        azure_arrivals(path, 50, 1.0, random.Random(0))
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(DemoError):
        azure_arrivals(bad, 1, 1.0, random.Random(0))


def test_plan_from_trace_folder(tmp_path):
    data = _fake_data(tmp_path / "data")
    pairs = dict(load_alpaca(data))
    assert len(pairs) == 30 and pairs["Instruction number 1?"] == 15
    cfg = DemoConfig(duration=60, chat_rate=1.0, deadline_rate=0.5, research_tasks=1, tot_tasks=1)
    plan = build_plan(cfg, data)
    assert plan.prompt_source == "alpaca_eval" and plan.arrival_source.startswith("azure:")
    reqs = [j for j in plan.jobs if j.kind in ("chat", "deadline")]
    assert {j.prompt for j in reqs} <= set(pairs)
    assert len(reqs) == 90  # every rescaled arrival lies inside the window
    for j in reqs:
        lo, hi = cfg.chat_tokens if j.kind == "chat" else cfg.deadline_tokens
        assert j.max_tokens == max(lo, min(hi, int(pairs[j.prompt] * 1.3)))
    with pytest.raises(DemoError):
        load_alpaca(tmp_path)


def test_plan_from_real_traces(shared_data):
    cfg = DemoConfig(duration=120)
    plan = build_plan(cfg, shared_data)
    assert plan.prompt_source == "alpaca_eval" and "conv" in plan.arrival_source
    n = plan.counts()["chat"] + plan.counts()["deadline"]
    assert abs(n - (cfg.chat_rate + cfg.deadline_rate) * cfg.duration) <= 1


def test_summarize_counts_goodput_per_kind():
    recs = [
        ReqRecord("chat", 0, "ok", True, 0.1, 2.0, 10, 50, 50),
        ReqRecord("chat", 1, "ok", False, 3.0, 9.0, 10, 50, 20),
        ReqRecord("chat", 2, "rejected"),
        ReqRecord("deadline", 0, "ok", True, 0.2, 5.0, 30, 100, 130),
        ReqRecord("deadline", 3, "unfinished"),
    ]
    tasks = [{"outcome": "succeeded", "tokens": 1000, "elapsed": 30.0, "stages": [{"output_tokens": 70}] * 3},
             {"outcome": "deadline_missed", "tokens": 800, "elapsed": 70.0},
             {"outcome": "failed", "tokens": 10, "elapsed": None}]
    s = summarize_run(recs, tasks, duration=10.0)
    assert s["chat"]["n"] == 3 and s["chat"]["met"] == 1 and s["chat"]["attainment"] == pytest.approx(1 / 3)
    assert s["chat"]["goodput_tokens"] == 70 and s["chat"]["rejected"] == 1
    assert s["deadline"]["goodput_tokens"] == 130 and s["deadline"]["unfinished"] == 1
    assert s["compound"]["met"] == 1 and s["compound"]["goodput_tokens"] == 1000
    assert s["compound"]["errors"] == 1 and s["compound"]["deadline_missed"] == 1
    assert s["compound"]["p50_e2el"] == pytest.approx(50.0)
    assert s["all"]["goodput_tokens"] == 1200 and s["all"]["goodput_tok_s"] == pytest.approx(120.0)
    assert s["all"]["attainment"] == pytest.approx(3 / 8)
    # the output tokens of what met its SLO: one chat, one deadline request, one task's three calls
    assert (s["chat"]["met_output_tokens"], s["deadline"]["met_output_tokens"]) == (50, 100)
    assert s["compound"]["met_output_tokens"] == 210 and s["all"]["met_output_tokens"] == 360
    empty = summarize_run([], [], 1.0)
    assert empty["chat"]["attainment"] is None and math.isclose(empty["all"]["goodput_tok_s"], 0.0)


@pytest.mark.parametrize("args", [["--phase-duration", "-1"], ["--data", "/nonexistent/dir"], ["--baseline", "nope"],
                                  ["--policy", "nope"], ["--burst-load", "0"], ["--capacity", "-2"],
                                  ["--baseline", "gmax"], ["--patterns", "/nonexistent.jsonl"]])
def test_cli_rejects_bad_parameters(args):
    r = CliRunner().invoke(cli_app, ["demo", *args])
    assert r.exit_code == 2, r.output


def test_server_start_failure_is_a_clean_error(tmp_path):
    p = subprocess.run([sys.executable, "-m", "jitflow_server.cli", "demo", "--model", str(tmp_path / "missing"),
                        "--phase-duration", "5", "--capacity", "1", "--out", str(tmp_path / "r.json"),
                        "--startup-timeout", "60"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert "exited with code" in p.stdout + p.stderr
    assert not (tmp_path / "r.json").exists()


def test_slos_scale_with_the_measured_step_time():
    from jitflow_server.api.state import ServerSettings
    from jitflow_server.demo.calibrate import Capacity
    from jitflow_server.demo.main import REFERENCE_STEP_S, DemoOptions, _phases, slo_factor

    def cap(step_s: float) -> Capacity:
        return Capacity("k", 200.0, step_s, 150.0, 200.0 / 150.0, 24, 16.0, "now")

    opts = DemoOptions(slos=DemoConfig(grace=20.0))
    slow = _phases(opts, cap(2 * REFERENCE_STEP_S))
    base = opts.slos
    for ph in slow:  # twice as slow an engine: every time SLO doubles, the token ranges do not change
        c = ph.cfg
        assert (c.ttft, c.tbt, c.deadline) == pytest.approx((2 * base.ttft, 2 * base.tbt, 2 * base.deadline))
        assert (c.research_deadline, c.tot_deadline) == pytest.approx((2 * base.research_deadline,
                                                                       2 * base.tot_deadline))
        assert c.deadline_tokens == base.deadline_tokens and c.grace == base.grace
        assert c.waiting_time == pytest.approx(2 * base.waiting_time)  # admission keeps its share of the deadline
    assert base.waiting_time == ServerSettings().default_waiting_time  # as set: the server's own default
    assert slo_factor(opts, cap(100 * REFERENCE_STEP_S)) == 4.0  # clipped
    fast = _phases(opts, cap(0.5 * REFERENCE_STEP_S))  # a faster full batch keeps the SLOs as set
    assert (fast[0].cfg.ttft, fast[0].cfg.tbt, fast[1].cfg.deadline, fast[1].cfg.waiting_time) == (
        base.ttft, base.tbt, base.deadline, base.waiting_time)
    assert slo_factor(opts, cap(float("nan"))) == 1.0  # unknown step time (--capacity given)
    off = DemoOptions(slos=DemoConfig(grace=20.0), scale_slos=False)
    assert _phases(off, cap(2 * REFERENCE_STEP_S))[0].cfg.tbt == base.tbt


def test_the_burst_overload_stretches_with_the_slos():
    from jitflow_server.demo.calibrate import Capacity
    from jitflow_server.demo.main import REFERENCE_STEP_S, DemoOptions, _phases, phase_load

    assert phase_load(1.5, 1.0) == 1.5 and phase_load(0.7, 2.0) == 0.7  # no stretch, or under capacity
    assert phase_load(1.5, 2.0) == pytest.approx(2.0)  # twice the SLOs: twice the queue growth
    opts = DemoOptions(slos=DemoConfig(grace=20.0))
    cap = Capacity("k", 200.0, 2 * REFERENCE_STEP_S, 150.0, 200.0 / 150.0, 24, 16.0, "now")
    normal, burst = _phases(opts, cap)
    assert normal.load == pytest.approx(0.7) and burst.load == pytest.approx(2.0)
    assert burst.scale == pytest.approx(2.0 * cap.scale)
    assert burst.cfg.chat_rate == pytest.approx(2.0 / 0.7 * normal.cfg.chat_rate)
    off = DemoOptions(slos=DemoConfig(grace=20.0), scale_slos=False)
    assert _phases(off, cap)[1].load == pytest.approx(1.5)


def test_the_command_line_without_its_extras_names_the_install_line():
    code = ("import sys; sys.modules['typer'] = None; sys.modules['rich'] = None\n"
            "from jitflow_server.entry import main; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "typer, rich" in r.stderr and "pip install 'jitflow[server]'" in r.stderr
    ok = subprocess.run([sys.executable, "-c", "from jitflow_server.entry import missing; print(missing())"],
                        capture_output=True, text=True, timeout=60)
    assert ok.stdout.strip() == "[]"  # this environment has the extras


def test_window_rates_count_each_streams_tokens_in_its_window():
    """Chunks are counted in the window they arrive in, times the stream's tokens per chunk (a stream
    still running takes the finished streams' mean)."""
    from jitflow_server.demo.calibrate import _window_rates

    streams = [[[0.5, 1.5, 2.5], 2.0],  # finished: 2 tokens per chunk
               [[1.2, 1.8], None]]  # still running: the mean of the finished, 2.0
    assert _window_rates(streams, [0.0, 1.0, 2.0, 4.0]) == [2.0, 6.0, 1.0]


@pytest.mark.parametrize("rates,expected", [
    ([100.0], 100.0),  # one window: its own reading
    ([79.0, 185.0, 190.0], 187.5),  # settled once the rise is at most 10 %: the last two
    ([80.0, 120.0, 160.0, 200.0], 200.0),  # still rising after the last window: the last
    ([200.0, 150.0], 175.0),  # a fall counts as settled
])
def test_the_capacity_is_read_once_the_windows_settle(rates, expected):
    from jitflow_server.demo.calibrate import settled_capacity

    assert settled_capacity(rates) == pytest.approx(expected)
    with pytest.raises(ValueError):
        settled_capacity([])


def test_a_phase_may_end_once_nothing_left_can_meet_its_slo():
    """The load runner ends a phase early only when every job still running is past its deadline: deadline
    requests by their own deadline (or the phase's), agent tasks by theirs, chat requests never."""
    from jitflow_server.demo.plan import LoadItem
    from jitflow_server.demo.runner import is_past_due

    task = LoadItem(10.0, "tot", deadline=45.0)
    assert not is_past_due(task, 54.9, request_deadline=20.0)
    assert is_past_due(task, 55.1, request_deadline=20.0)
    own = LoadItem(5.0, "deadline", "q", 64, deadline=8.0)
    assert not is_past_due(own, 12.9, request_deadline=20.0) and is_past_due(own, 13.1, request_deadline=20.0)
    phase = LoadItem(5.0, "deadline", "q", 64)  # no deadline of its own: the phase's
    assert not is_past_due(phase, 24.9, request_deadline=20.0) and is_past_due(phase, 25.1, request_deadline=20.0)
    assert not is_past_due(LoadItem(0.0, "chat", "hi", 16), 1e6, request_deadline=20.0)
