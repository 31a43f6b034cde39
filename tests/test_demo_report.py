"""``jitflow demo`` parts that need no server: the capacity arithmetic and its cache, phase sizing, the
comparison and its targets, the markdown and PNG reports, and the length model's cache naming."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from jitflow_server.demo import BASE_MIX, DemoConfig, ReqRecord, phase_config, plot_report, summarize_run
from jitflow_server.demo.calibrate import (
    STALE_SPREAD,
    CallShape,
    Capacity,
    is_stale,
    load_cached,
    machine_key,
    mix_demand,
    mix_shapes,
    save_cached,
    task_calls,
)
from jitflow_server.demo.length_model import SHIPPED_CORPUS, model_path, training_sources
from jitflow_server.demo.main import DemoOptions, speed_warning
from jitflow_server.demo.options import side_cores
from jitflow_server.demo.plan import REPO_ROOT
from jitflow_server.demo.report import (
    build_report,
    check_targets,
    compare_phase,
    met_output_share,
    token_ceiling,
    write_markdown,
)
from jitflow_server.demo.results import RunResult

PATTERNS = sorted((REPO_ROOT / "patterns").glob("*.jsonl"))


def test_task_calls_read_the_shipped_pattern_corpora():
    calls = task_calls(PATTERNS)
    assert set(calls) >= {"deep-research", "tree-of-thoughts"}
    for tasks in calls.values():
        assert tasks and all(len(t) >= 2 and all(i > 0 and o > 0 for i, o in t) for t in tasks)


def test_mix_demand_weights_each_call_by_its_rate(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join([
        json.dumps({"app": "deep-research", "stages": [{"c": [{"k": "llm", "i": 10, "o": 100},
                                                              {"k": "tool", "m": "web_search"}]}]}),
        json.dumps({"app": "tree-of-thoughts", "stages": [{"c": [{"k": "llm", "i": 5, "o": 40}]},
                                                          {"c": [{"k": "llm", "i": 5, "o": 60}]}]}),
        "not json",
    ]))
    shapes = mix_shapes([("a", 50), ("b", 150)], [("c", 200)], task_calls([corpus]))
    want = (BASE_MIX.chat_rate * 100 + BASE_MIX.deadline_rate * 200 + BASE_MIX.research_rate * 100
            + BASE_MIX.tot_rate * (40 + 60))
    assert mix_demand(shapes) == pytest.approx(want)
    assert sum(s.prompt_tokens > 0 for s in shapes) == 3 and sum(s.text is not None for s in shapes) == 3


@pytest.mark.parametrize(("cpus", "n", "want"), [({0, 1}, 2, ["0", "1"]), ({2, 3, 0, 1}, 2, ["0,1", "2,3"]),
                                                 ({0, 1, 2}, 2, ["0", "1"]), ({5}, 2, None), ({0, 1}, 1, None)])
def test_each_side_gets_cores_of_its_own(monkeypatch, cpus, n, want):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus))  # the machine's cores
    assert side_cores(n) == want


def test_capacity_cache_round_trip_and_corrupt_file(tmp_path):
    cache = tmp_path / "cap.json"
    key = machine_key("demo", "bfloat16", 32)
    assert key != machine_key("tiny", "bfloat16", 32) and key != machine_key("demo", "float32", 32)
    assert key == machine_key("demo", "bfloat16", 32)
    # an engine bound to one core is measured apart from one with vLLM's own binding
    assert machine_key("demo", "bfloat16", 32, "1") == machine_key("demo", "bfloat16", 32, "0") != key
    # the capacity is kept in units of the mix it was measured with: another mix is another measurement
    # (its agent-task calls, from the pattern corpora); the chat prompts, drawn per seed, share one
    one = [CallShape(64, 0.4, text="Say hello."), CallShape(32, 0.1, prompt_tokens=300)]
    other = [CallShape(64, 0.4, text="Say hello."), CallShape(48, 0.1, prompt_tokens=300)]
    with_mix = machine_key("demo", "bfloat16", 32, mix=one)
    assert with_mix == machine_key("demo", "bfloat16", 32, mix=list(one)) != key
    assert with_mix != machine_key("demo", "bfloat16", 32, mix=other)
    assert with_mix == machine_key("demo", "bfloat16", 32, mix=[CallShape(80, 0.4, text="Say hi.")] + one[1:])
    assert load_cached(key, cache) is None
    cap = Capacity(key, 600.0, 0.05, 150.0, 4.0, 300, 20.0, "2026-11-25T00:00:00Z")
    save_cached(cap, cache)
    other = Capacity("other", 1.0, 1.0, 1.0, 1.0, 1, 1.0, "x")
    save_cached(other, cache)
    got = load_cached(key, cache)
    assert got is not None and got.cached and got.out_tok_s == 600.0 and got.scale == 4.0
    cache.write_text("{broken")
    assert load_cached(key, cache) is None
    save_cached(cap, cache)  # a corrupt cache is replaced, not fatal
    assert load_cached(key, cache) is not None


def test_a_cached_capacity_is_stale_when_the_machine_speed_changed(tmp_path):
    """The probe stored with a measurement round-trips through the cache; a later probe more than
    ``STALE_SPREAD`` times slower or faster marks the entry stale; an entry without a probe (cached before
    probes were stored) or a failed probe now leaves the cache trusted."""
    cache = tmp_path / "cap.json"
    cap = Capacity("k", 600.0, 0.05, 150.0, 4.0, 300, 20.0, "2026-11-25T00:00:00Z", probe_tbt_s=0.040)
    save_cached(cap, cache)
    got = load_cached("k", cache)
    assert got is not None and got.probe_tbt_s == 0.040
    assert not is_stale(got, 0.040) and not is_stale(got, 0.040 * STALE_SPREAD * 0.99)
    assert not is_stale(got, 0.040 / (STALE_SPREAD * 0.99))
    assert is_stale(got, 0.040 * STALE_SPREAD * 1.01) and is_stale(got, 0.040 / (STALE_SPREAD * 1.01))
    assert not is_stale(got, None)
    entry = json.loads(cache.read_text())
    del entry["k"]["probe_tbt_s"]  # an entry written before probes were stored
    cache.write_text(json.dumps(entry))
    old = load_cached("k", cache)
    assert old is not None and old.probe_tbt_s is None and not is_stale(old, 0.5)


def test_phase_config_scales_rates_and_task_counts():
    slos = DemoConfig(ttft=1.5, tbt=0.08, grace=7.0)
    c = phase_config(3.0, 40.0, 5, slos)
    assert c.chat_rate == pytest.approx(1.2) and c.deadline_rate == pytest.approx(0.6)
    assert c.research_tasks == round(BASE_MIX.research_rate * 3 * 40) and c.tot_tasks == round(BASE_MIX.tot_rate * 120)
    assert (c.ttft, c.tbt, c.grace, c.seed, c.duration) == (1.5, 0.08, 7.0, 5, 40.0)
    assert phase_config(0.01, 10.0, 0, slos).research_tasks == 1  # at least one task of each app
    with pytest.raises(ValueError, match="scale"):
        phase_config(0.0, 10.0, 0, slos)


def _run(side: str, phase: str, chat_met: int, deadline_met: int, tasks_met: int) -> RunResult:
    recs = [ReqRecord("chat", float(i), "ok", i < chat_met, 0.2, 3.0, 10, 50, 50 if i < chat_met else 0, tbt=0.05)
            for i in range(10)]
    recs += [ReqRecord("deadline", float(i), "ok" if i < deadline_met else "rejected", i < deadline_met, 0.3, 8.0,
                       20, 100, 120 if i < deadline_met else 0) for i in range(5)]
    tasks = [{"t": float(i), "app": "deep-research", "outcome": "succeeded" if i < tasks_met else "deadline_missed",
              "tokens": 1000, "elapsed": 30.0, "stages": [{"output_tokens": 300}, {"output_tokens": 100}]}
             for i in range(4)]
    # the engine generated every record's and every task's output, plus 1 000 tokens of abandoned calls
    run = RunResult(side, phase=phase, records=recs, tasks=tasks, wall=40.0,
                    generated_output_tokens=10 * 50 + 5 * 100 + 4 * 400 + 1000)
    run.summary = summarize_run(recs, tasks, 40.0)
    return run


def test_comparison_ratios_and_targets():
    base = _run("vllm", "burst", 2, 1, 1).summary
    main = _run("gmax", "burst", 9, 4, 3).summary
    c = compare_phase(main, base)
    assert c["token_goodput_ratio"] == pytest.approx(main["all"]["goodput_tokens"] / base["all"]["goodput_tokens"])
    assert c["request_goodput_ratio"] == pytest.approx(16 / 4)
    assert c["compound_met"] == [3, 1] and c["compound_n"] == 4
    normal = compare_phase(_run("gmax", "normal", 9, 5, 4).summary, _run("vllm", "normal", 10, 5, 4).summary)
    t = check_targets({"burst": c, "normal": normal})
    assert t["burst_token_goodput_ratio_ge_1_3"] and t["burst_more_compound_met"]
    assert t["normal_attainment_ge_0_9_every_kind"]  # chat 0.9, deadline 1.0, compound 1.0
    assert t["normal_attainment_not_below_baseline"] is False  # chat 0.9 < 1.0
    alone = check_targets({"burst": compare_phase(main, None)})
    assert alone["burst_token_goodput_ratio_ge_1_3"] is None and alone["normal_attainment_ge_0_9_every_kind"] is None


def test_the_token_ceiling_is_every_unit_met_over_the_baseline():
    base, main = _run("vllm", "burst", 2, 1, 1), _run("gmax", "burst", 9, 4, 3)
    # every unit met: 10 chats × 50 output tokens + 5 deadline requests × (20 + 100) + 4 tasks × 1000
    assert base.summary["all"]["goodput_tokens"] == 2 * 50 + 120 + 1000
    assert token_ceiling(main, base) == pytest.approx(5100 / 1220)
    main.records[3].output_tokens = 0  # refused on one side: the other side's tokens count
    assert token_ceiling(main, base) == pytest.approx(5100 / 1220)
    assert token_ceiling(_run("gmax", "burst", 9, 4, 3), RunResult("vllm", phase="burst")) is None  # unpaired


def test_the_in_slo_share_counts_the_output_of_units_that_met_their_slo():
    run = _run("vllm", "burst", 2, 1, 1)
    # chat 2 × 50, deadline 1 × 100 (its prompt is not output), task 1 × (300 + 100)
    assert run.summary["all"]["met_output_tokens"] == 100 + 100 + 400
    assert run.summary["compound"]["met_output_tokens"] == 400
    assert met_output_share(run) == pytest.approx(600 / 3600)
    assert met_output_share(_run("gmax", "burst", 10, 5, 4)) == pytest.approx(2600 / 3600)
    run.generated_output_tokens = None  # the server's counter could not be read
    assert met_output_share(run) is None


def _report(tmp_path: Path, served_model: bool) -> dict:
    opts = DemoOptions(out=tmp_path / "r.json")
    cap = Capacity("k", 600.0, 0.05, 150.0, 4.0, 300, 20.0, "2026-11-25T00:00:00Z")
    phases = [SimpleNamespace(name=n, load=x, scale=4.0 * x, cfg=phase_config(4.0 * x, 40.0, 0, opts.slos),
                              plan=SimpleNamespace(prompt_source="builtin", arrival_source="poisson",
                                                   counts=lambda: {"chat": 10}))
              for n, x in (("normal", 0.7), ("burst", 1.5))]
    sides = opts.sides()
    runs = [_run("vllm", "normal", 10, 5, 4), _run("vllm", "burst", 2, 1, 1),
            _run("gmax", "normal", 10, 5, 4), _run("gmax", "burst", 9, 4, 3)]
    length = SimpleNamespace(path=tmp_path / "m.pkl", source_kind="alpaca_eval", sources=[tmp_path / "a.json"],
                             trained=True)
    served = {"vllm": None, "gmax": {"model": served_model, "version": "qrf-test" if served_model else None}}
    rep = build_report(opts, cap, phases, sides, runs, length, served, 2)
    rep["wall_s"] = 300.0
    return rep


def test_report_json_markdown_and_plot(tmp_path):
    rep = _report(tmp_path, served_model=True)
    json.dumps(rep)  # serialisable as written
    assert [s["label"] for s in rep["sides"]] == ["vllm", "gmax"] and rep["baseline"] == "vllm"
    assert rep["length_predictor"]["used"] == "qrf" and rep["length_predictor"]["warning"] is None
    assert rep["failed_tasks"] == 0 and rep["targets"]["burst_more_compound_met"] is True
    assert rep["comparison"]["burst"]["token_goodput_ceiling"] == pytest.approx(5100 / 1220)
    assert [(r["side"], r["phase"]) for r in rep["runs"]][-1] == ("gmax", "burst")
    assert rep["comparison"]["burst"]["met_output_share"] == pytest.approx([2050 / 3600, 600 / 3600])  # 9×50 + 4×100 + 3×400
    assert rep["runs"][1]["generated_output_tokens"] == 3600 and rep["runs"][1]["met_output_share"] == pytest.approx(1 / 6)
    md = tmp_path / "r.md"
    rep["analyzer_time_model"] = {"gmax": {"decode_s_per_token": 0.059, "prefill_s_per_token": 0.0011,
                                           "source": "measured"}}  # as run_demo reads it from the server
    write_markdown(rep, md)
    text = md.read_text()
    assert "| burst | gmax |" in text and "token goodput ratio" in text and "qrf" in text
    assert "Analyzer call-time model (gmax): 59 ms per decoded token, 1.10 ms per prompt token (measured)" in text
    assert "| 3600 | 17% |" in text and "output tokens that met an SLO 57% vs 17%" in text
    png = tmp_path / "r.png"
    plot_report(rep, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_fallback_length_predictor_is_a_warning(tmp_path):
    rep = _report(tmp_path, served_model=False)
    assert rep["length_predictor"]["used"] == "fallback"
    assert "did not load the trained length model" in rep["length_predictor"]["warning"]
    write_markdown(rep, tmp_path / "r.md")
    assert "**Warning**" in (tmp_path / "r.md").read_text()


def test_length_model_cache_name_follows_the_training_bytes(tmp_path):
    a = tmp_path / "a.json"
    a.write_text("[1]")
    p1 = model_path([a], tmp_path)
    assert p1 == model_path([a], tmp_path) and p1.parent == tmp_path
    a.write_text("[2]")
    assert model_path([a], tmp_path) != p1


def test_training_sources_prefer_alpaca_then_the_shipped_corpus(tmp_path):
    (tmp_path / "alpaca_eval").mkdir()
    (tmp_path / "alpaca_eval" / "m.json").write_text("[]")
    files, kind = training_sources(tmp_path)
    assert kind == "alpaca_eval" and files == [tmp_path / "alpaca_eval" / "m.json"]
    assert SHIPPED_CORPUS.is_file()
    files, kind = training_sources(tmp_path / "missing")
    assert kind == "shipped telemetry" and files == [SHIPPED_CORPUS]


def test_speed_warning_when_the_machine_slowed_down():
    assert speed_warning({"vllm": {"before": 0.010, "after": 0.011}, "gmax": {"before": 0.012, "after": 0.0105}}) is None
    msg = speed_warning({"vllm": {"before": 0.010, "after": 0.010}, "gmax": {"before": 0.030, "after": 0.011}})
    assert msg is not None and "10-30 ms" in msg
    assert speed_warning({"vllm": {"before": None, "after": None}}) is None


def test_capacity_warning_when_the_cached_capacity_was_measured_at_another_speed():
    from jitflow_server.demo.calibrate import Capacity, capacity_warning

    def cap(cached: bool, probe: float | None) -> Capacity:
        return Capacity("k", 194.0, 0.164, 148.0, 1.31, 30, 16.0, "2026-11-27T19:10:25Z", cached, probe)

    faster = {"vllm": {"before": 0.0188, "after": 0.0179}, "gmax": {"before": 0.0197, "after": 0.0169}}
    msg = capacity_warning(cap(True, 0.0303), faster)
    assert msg and "slower machine" in msg and "lighter" in msg and "--recalibrate" in msg and "30 ms" in msg
    slower = {"vllm": {"before": 0.045, "after": 0.050}}
    assert "faster machine" in capacity_warning(cap(True, 0.0303), slower)
    assert capacity_warning(cap(True, 0.0200), faster) is None  # within the probe's noise
    assert capacity_warning(cap(False, 0.0303), faster) is None  # measured in this run
    assert capacity_warning(cap(True, None), faster) is None  # no probe with the measurement (--capacity)
    assert capacity_warning(cap(True, 0.0303), {"vllm": {"before": None, "after": None}}) is None


def test_events_are_written_into_a_report_folder_that_does_not_exist_yet(tmp_path):
    """``jitflow demo --events --out DIR/report.json``: the first phase's events are written before the
    report makes ``DIR``; the writer makes it (it raised FileNotFoundError after the first phase)."""
    from jitflow_server.demo.events import EventRecorder, ServerEvent, events_path, write_events

    rec = EventRecorder("http://127.0.0.1:9", "gmax", "normal")
    rec.events.append(ServerEvent("gmax", "normal", "server", 1.0, "arrive", "r1", "chat"))
    path = events_path(tmp_path / "new" / "deeper" / "demo-report.json")
    assert write_events([rec], path) == 1
    assert write_events([rec], path) == 1  # appended, not replaced
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["request_id"] for x in lines] == ["r1", "r1"] and lines[0]["event"] == "arrive"
