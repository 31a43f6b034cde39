"""``jitflow demo`` on the real engine (tiny model): the capacity measurement against the session's server,
and the whole demo, stock vLLM against GMAX on the same arrivals, with short phases."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from rich.console import Console

from jitflow_server.demo import DemoConfig, DemoOptions, run_demo
from jitflow_server.demo.calibrate import (
    CAPACITY_ROUNDS,
    measure_capacity,
    mix_shapes,
    settled_capacity,
    task_calls,
)
from jitflow_server.demo.plan import REPO_ROOT

pytestmark = pytest.mark.engine


def test_capacity_measurement_on_the_real_engine(server_url):
    patterns = sorted((REPO_ROOT / "patterns").glob("*.jsonl"))
    shapes = mix_shapes([("Say hello.", 16)], [("Explain a bit.", 24)], task_calls(patterns))
    cap = measure_capacity(server_url, "tiny", shapes, key="test", batch_size=4, warmup=1.0, window=3.0)
    assert cap.requests > 0 and cap.out_tok_s > 0 and math.isfinite(cap.step_s) and cap.step_s > 0
    assert cap.scale == pytest.approx(cap.out_tok_s / cap.demand_tok_s)
    # The window's in-flight requests were cancelled, not left running.
    for _ in range(40):
        st = httpx.get(server_url + "/v1/jitflow/engine", timeout=10).json()
        if not st.get("unfinished") and not st.get("server_in_flight"):
            break
        import time

        time.sleep(0.5)
    assert not st.get("unfinished") and not st.get("server_in_flight")


def test_the_event_recorder_keeps_each_lifecycle_event_of_a_request_once(server_url):
    import anyio

    from jitflow_server.demo.events import EventRecorder

    r = httpx.post(server_url + "/v1/completions", json={"model": "tiny", "prompt": "Say hello.", "max_tokens": 4,
                                                         "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    later = EventRecorder(server_url, "gmax", "burst")  # made after the request: none of its events
    anyio.run(later.final)
    assert not [e for e in later.events if e.request_id.startswith(rid)]
    rec = EventRecorder(server_url, "gmax", "normal", since=0.0)
    anyio.run(rec.final)
    anyio.run(rec.final)  # a second read of the same events adds nothing
    mine = [(e.source, e.event) for e in rec.events if e.request_id.startswith(rid)]
    assert ("server", "arrive") in mine and ("server", "first_token") in mine and ("server", "done") in mine
    assert ("engine", "add") in mine and ("engine", "finish") in mine
    assert len(mine) == len(set(mine)) and rec.failed_reads == 0
    assert all(e.side == "gmax" and e.phase == "normal" for e in rec.events)
    gone = EventRecorder("http://127.0.0.1:9", "gmax", "normal")  # nothing listens: counted, not raised
    anyio.run(gone.final)
    assert gone.failed_reads == 1 and gone.events == []


def test_capacity_window_opens_only_when_ready(server_url):
    """``ready`` holds the counting window shut after the warm-up (the demo trains its length model
    meanwhile): the measurement lasts warm-up + the wait + the window, and counts only the window."""
    import time

    patterns = sorted((REPO_ROOT / "patterns").glob("*.jsonl"))
    shapes = mix_shapes([("Say hello.", 16)], [("Explain a bit.", 24)], task_calls(patterns))
    t0 = time.monotonic()
    polls = []

    def ready() -> bool:
        polls.append(time.monotonic() - t0)
        return polls[-1] >= 3.0

    cap = measure_capacity(server_url, "tiny", shapes, key="test", batch_size=4, warmup=1.0, window=2.0,
                           ready=ready)
    elapsed = time.monotonic() - t0
    assert polls[0] < 3.0 <= polls[-1] and len(polls) >= 5
    assert elapsed >= 5.0  # 1 s warm-up, held until 3 s, then a 2 s window
    # counting windows of 2 s, one after another until one reads at most 10 % more than the one before
    assert 1 <= len(cap.window_rates) <= CAPACITY_ROUNDS and cap.window_s == 2.0 * len(cap.window_rates)
    assert cap.requests > 0 and cap.out_tok_s == settled_capacity(cap.window_rates) > 0
    if len(cap.window_rates) < CAPACITY_ROUNDS:  # it stopped early: the last window had settled
        assert cap.window_rates[-1] <= 1.1 * cap.window_rates[-2]


def test_a_stale_cached_capacity_is_measured_again(server_url, tmp_path):
    """A cached capacity whose stored lone-request probe no longer matches this engine's speed is measured
    again on the server, and the new measurement with its probe replaces the entry; an entry without a
    probe is used as cached."""
    from jitflow_server.demo.calibrate import Capacity, load_cached, machine_key, save_cached
    from jitflow_server.demo.capacity import resolve_capacity

    patterns = sorted((REPO_ROOT / "patterns").glob("*.jsonl"))
    shapes = mix_shapes([("Say hello.", 16)], [("Explain a bit.", 24)], task_calls(patterns))
    cache = tmp_path / "cap.json"
    opts = DemoOptions(model="tiny", batch_size=4, calibration_window=2.0, capacity_cache=cache, seed=1)
    key = machine_key("tiny", None, 4, mix=shapes)
    settled = []
    console = Console(file=open(tmp_path / "console.txt", "w"), width=200)  # noqa: SIM115
    save_cached(Capacity(key, 1.0, 9.0, 1.0, 1.0, 1, 2.0, "long ago"), cache)  # no probe: trusted
    cap = resolve_capacity(opts, server_url, None, shapes, console, settle=lambda: settled.append(1))
    assert cap.cached and cap.out_tok_s == 1.0 and settled == [1]
    save_cached(Capacity(key, 1.0, 9.0, 1.0, 1.0, 1, 2.0, "long ago", probe_tbt_s=100.0), cache)  # far slower
    cap = resolve_capacity(opts, server_url, None, shapes, console, settle=lambda: settled.append(2))
    console.file.close()
    assert settled == [1, 2] and not cap.cached and cap.requests > 0 and cap.out_tok_s != 1.0
    assert cap.probe_tbt_s is not None and 0 < cap.probe_tbt_s < 100.0
    stored = load_cached(key, cache)
    assert stored is not None and stored.measured_at == cap.measured_at and stored.probe_tbt_s == cap.probe_tbt_s
    assert "speed changed since its capacity was measured" in (tmp_path / "console.txt").read_text()


@pytest.mark.parametrize("together", [True, False], ids=["at-once", "in-turn"])
def test_demo_runs_stock_vllm_and_gmax_on_the_same_arrivals(tmp_path, together):
    slos = DemoConfig(chat_tokens=(8, 24), deadline_tokens=(8, 24), research_deadline=60, tot_deadline=60, grace=20)
    opts = DemoOptions(model="tiny", phase_duration=4.0, capacity_scale=4.0, slos=slos, seed=3,
                       out=tmp_path / "demo-report.json", model_cache=tmp_path / "models", batch_size=8,
                       together=together, events=not together)
    stale = tmp_path / "demo-report.events.jsonl"
    stale.write_text('{"left": "by an earlier run"}\n')
    console = Console(file=open(tmp_path / "console.txt", "w"), width=200)  # noqa: SIM115
    report = run_demo(opts, console)
    console.file.close()
    on_disk = json.loads((tmp_path / "demo-report.json").read_text())
    assert on_disk["version"] == report["version"] == 2
    assert report["model"] == "tiny" and report["model_choice"]["requested"] == "tiny"
    if together:  # both at once, each engine's compute threads on cores of its own
        assert report["together"] is True and set(report["cores"]) == {"vllm", "gmax"}
        cores = [set(c.split(",")) for c in report["cores"].values()]
        assert cores[0] and cores[1] and not cores[0] & cores[1]
        assert [(r["side"], r["phase"]) for r in report["runs"]] == [("vllm", "normal"), ("gmax", "normal"),
                                                                      ("vllm", "burst"), ("gmax", "burst")]
    else:  # in turn: the phases interleaved, the sides' order reversed in the second phase
        assert report["together"] is False and report["cores"] is None
        assert [(r["side"], r["phase"]) for r in report["runs"]] == [("vllm", "normal"), ("gmax", "normal"),
                                                                      ("gmax", "burst"), ("vllm", "burst")]
    by = {(r["side"], r["phase"]): r for r in report["runs"]}
    for phase in ("normal", "burst"):
        a, b = by[("vllm", phase)], by[("gmax", phase)]
        assert [(x["kind"], x["t"]) for x in a["records"]] == [(x["kind"], x["t"]) for x in b["records"]]
        assert sorted(t["input"] for t in a["tasks"]) == sorted(t["input"] for t in b["tasks"])
        assert a["summary"]["compound"]["n"] >= 2
    assert report["failed_tasks"] == 0
    for run in report["runs"]:  # the server's own count of what it generated covers what met an SLO
        assert run["generated_output_tokens"] >= run["summary"]["all"]["met_output_tokens"] > 0
        assert 0 < run["met_output_share"] <= 1
    for side in ("vllm", "gmax"):
        probe = report["speed_probe_tbt_s"][side]
        assert probe["before"] > 0 and probe["after"] > 0
    # Where the time went (per side in turn, for both at once): every step counted once, the phases at
    # least as long as their runs.
    timings = report["timings_s"]
    assert set(timings) == ({"vllm+gmax"} if together else {"vllm", "gmax"})
    for label, laps in timings.items():
        assert set(laps) == {"server_start_s", "warmup_s", "capacity_s", "warm_engine_s", "probes_s", "phases_s"}
        for side in label.split("+"):
            assert laps["phases_s"] >= sum(by[(side, p)]["wall"] for p in ("normal", "burst"))
    assert sum(sum(t.values()) for t in timings.values()) <= report["wall_s"]
    # The burst phase offers more than the normal phase.
    n_normal, n_burst = (sum(report["phases"][i]["counts"].values()) for i in (0, 1))
    assert n_burst > n_normal
    # the jitflow side's analyzer planned with its engine's measured speed (the stock side has none)
    assert set(report["analyzer_time_model"]) == {"gmax"}
    assert report["analyzer_time_model"]["gmax"]["source"] == "measured"
    assert report["analyzer_time_model"]["gmax"]["decode_s_per_token"] > 0
    lp = report["length_predictor"]
    assert lp["used"] == "qrf" and lp["trained_this_run"] and lp["source"] == "shipped telemetry"
    assert lp["served"]["vllm"] is None and lp["served"]["gmax"]["model"] is True
    ratio = report["comparison"]["burst"]["token_goodput_ratio"]
    b_gp = by[("vllm", "burst")]["summary"]["all"]["goodput_tokens"]
    assert ratio == pytest.approx(by[("gmax", "burst")]["summary"]["all"]["goodput_tokens"] / b_gp)
    assert set(report["targets"]) == {"burst_token_goodput_ratio_ge_1_3", "burst_more_compound_met",
                                      "normal_attainment_ge_0_9_every_kind", "normal_attainment_not_below_baseline"}
    assert (tmp_path / "demo-report.md").read_text().startswith("# jitflow demo report")
    assert (tmp_path / "demo-report.png").read_bytes()[:4] == b"\x89PNG"
    text = (tmp_path / "console.txt").read_text()
    assert "both schedulers on the same arrivals" in text and "stock vLLM scheduler, no plug-in" in text
    if together:  # no --events: the file of an earlier run is left alone
        assert stale.read_text().startswith('{"left"')
        return
    # --events: every side's and phase's lifecycle events, each once, the earlier run's file replaced
    rows = [json.loads(line) for line in stale.read_text().splitlines()]
    assert rows and all(set(r) == {"side", "phase", "source", "t", "event", "request_id", "detail"} for r in rows)
    assert len({json.dumps(r, sort_keys=True) for r in rows}) == len(rows)
    for (side, phase), run in by.items():
        mine = [r for r in rows if r["side"] == side and r["phase"] == phase]
        served = sum(1 for x in run["records"] if x["status"] == "ok")
        assert sum(r["event"] == "arrive" for r in mine) >= served > 0
        assert sum(r["event"] == "done" and "ok=True" in r["detail"] for r in mine) >= served
    assert any(r["side"] == "gmax" and r["source"] == "engine" and r["event"] == "add" for r in rows)
    for side in ("vllm", "gmax"):  # a phase's file holds its own requests only, not the last phase's left in the server
        ids = {p: {r["request_id"] for r in rows if r["side"] == side and r["phase"] == p and r["source"] == "server"}
               for p in ("normal", "burst")}
        assert ids["normal"] and ids["burst"] and not ids["normal"] & ids["burst"]
