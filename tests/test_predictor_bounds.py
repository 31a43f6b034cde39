"""Simulator length bounds from the real QRF length predictor (``bench/predictor_bounds.py``)."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import typer

from jitflow_server.analyzer.length_calibration import DEFAULT_QUANTILE
from jitflow_server.analyzer.stage_length import StageLengthSamples
from jitflow_server.bench import predictor_bounds as pb
from jitflow_server.bench.estimates import LengthBounder
from jitflow_server.bench.runner import RunSettings, run_sim_one
from jitflow_server.bench.workload import DataSources, make_workload
from jitflow_server.engine.jobs import CallSpec, Job
from jitflow_server.engine.step_model import StepModel

ALPACA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "alpaca_eval"
#: The production forest parameters, read before any test patches them.
PRODUCTION_PARAMS = dict(pb.TRAIN_PARAMS)
#: A small forest: the tests check the plumbing, not the model's quality.
SMALL_PARAMS = {"n_estimators": 8, "max_depth": 30, "min_samples_leaf": 5}
MODEL = StepModel(name="test", base_s=0.01, per_decode_s=0.0005, per_prefill_token_s=0.0002, per_ctx_token_s=1e-7,
                  hetero=0.1, kv_capacity_tokens=400_000, block_size=16, max_batched_tokens=2048,
                  sarathi_chunk=256, batch_size=16)
DECODE_S, PREFILL_S = MODEL.decode_token_time(MODEL.batch_size), MODEL.per_prefill_token_s


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The predictor source with a small forest, trained once into a temporary cache; skips without the data."""
    if not ALPACA.is_dir():
        pytest.skip(f"{ALPACA} is not present")
    mp = pytest.MonkeyPatch()
    mp.setattr(pb, "TRAIN_PARAMS", dict(SMALL_PARAMS))
    cache = tmp_path_factory.mktemp("sim-length")
    mp.setattr(pb, "sim_length_cache_dir", lambda: cache)
    yield pb.get_source(ALPACA)
    mp.undo()


@pytest.fixture(scope="module")
def builtin_data() -> DataSources:
    return DataSources.load(None)


def _single(job_id: str, length: int, arrival: float = 0.0, kind: str = "latency") -> Job:
    if kind == "latency":
        return Job(job_id, kind, arrival, "chat", [[CallSpec(200, length)]], ttft=2.0, tbt=0.1)
    return Job(job_id, kind, arrival, "batch", [[CallSpec(200, length)]], deadline=20.0)


def test_train_params_are_the_train_length_command_defaults():
    from jitflow_server.analyzer import length_cli

    app = typer.Typer()
    length_cli.register(app)
    cmd = next(c for c in app.registered_commands if c.name == "train-length")
    defaults = {n: getattr(p.default, "default", p.default) for n, p in inspect.signature(cmd.callback).parameters.items()}
    assert {k: defaults[k] for k in PRODUCTION_PARAMS} == PRODUCTION_PARAMS
    assert defaults["quantile"] == DEFAULT_QUANTILE


def test_missing_alpaca_data_names_the_path(tmp_path, builtin_data):
    missing = tmp_path / "nowhere" / "alpaca_eval"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        pb.alpaca_dir(missing)
    with pytest.raises(FileNotFoundError, match="alpaca_eval"):
        run_sim_one([_single("j0", 10)], MODEL, "gmax",
                    RunSettings(length_bound="predictor", alpaca_dir=missing), builtin_data)
    with pytest.raises(ValueError, match="PredictorBounder"):
        LengthBounder("predictor")


def test_attachment_is_deterministic_and_keeps_the_inputs(source, builtin_data):
    jobs = make_workload(60, 4.0, data=builtin_data, seed=1)
    before = [[(c.input_len, c.output_len) for s in j.stages for c in s] for j in jobs]
    a_jobs, a_map = pb.attach_held_out_prompts(jobs, source.items, seed=7)
    b_jobs, b_map = pb.attach_held_out_prompts(jobs, source.items, seed=7)
    _, c_map = pb.attach_held_out_prompts(jobs, source.items, seed=8)
    assert [[(c.input_len, c.output_len) for s in j.stages for c in s] for j in jobs] == before  # not mutated
    assert {k: v.item for k, v in a_map.items()} == {k: v.item for k, v in b_map.items()}
    assert {k: v.item for k, v in a_map.items()} != {k: v.item for k, v in c_map.items()}
    singles = [j for j in jobs if j.kind in pb.SINGLE_KINDS]
    assert set(a_map) == {f"{j.job_id}.0.0" for j in singles}
    assert len({v.item for v in a_map.values()}) == len(a_map)  # a permutation: no repeat below 805 calls
    for old, new in zip(jobs, a_jobs, strict=True):
        assert new is not old and (new.job_id, new.kind, new.arrival, new.app) == (old.job_id, old.kind, old.arrival, old.app)
        for s, (oc, nc) in enumerate(zip(old.stages, new.stages, strict=True)):
            for j, (o, n) in enumerate(zip(oc, nc, strict=True)):
                cid = f"{old.job_id}.{s}.{j}"
                assert n.input_len == o.input_len
                if old.kind in pb.SINGLE_KINDS:
                    assert n.output_len == a_map[cid].output_len
                else:
                    assert n.output_len == o.output_len


def test_bounds_never_read_the_true_length(source, builtin_data):
    item = max(source.items, key=lambda it: it.output_len if it.output_len < 600 else 0)
    jobs = [_single("a", item.output_len), _single("b", item.output_len)]
    jobs[1].stages[0][0].output_len = item.output_len + 777  # another recorded length
    mapping = {"a.0.0": item, "b.0.0": item}
    table = source.calibrated_table(mapping, jobs, DECODE_S, PREFILL_S)
    b = pb.PredictorBounder(table, pb.HistoryQuantiles(builtin_data, DEFAULT_QUANTILE))
    la, lb = jobs[0].stages[0][0].output_len, jobs[1].stages[0][0].output_len
    for g in range(0, item.output_len, 7):
        assert b.bound(la, g, 0.0, ("latency", "chat", 0), "a.0.0") == b.bound(lb, g, -3.0, ("latency", "chat", 0),
                                                                                "b.0.0")
    with pytest.raises(pb.PredictorBoundsError, match="no held-out prompt"):
        b.bound(item.output_len, 0, 0.0, ("latency", "chat", 0), "c.0.0")  # a call without a prompt


def test_refinement_every_50_tokens_with_g_plus_1_floor(source, builtin_data):
    jobs, mapping = pb.attach_held_out_prompts(make_workload(150, 4.0, data=builtin_data, seed=2), source.items, seed=0)
    table = source.calibrated_table(mapping, jobs, DECODE_S, PREFILL_S)
    b = pb.PredictorBounder(table, pb.HistoryQuantiles(builtin_data, DEFAULT_QUANTILE))
    ratios: dict[int, list[float]] = {0: [], 400: []}
    for cid, it in mapping.items():
        prev = None
        for g in range(it.output_len):
            v = b.bound(it.output_len, g, 0.0, ("deadline", "batch", 0), cid)
            assert v >= g + 1
            if g % pb.REFINE_EVERY and prev is not None:
                assert v == max(prev, g + 1)  # kept between refinements, lifted to g + 1 only
            prev = v
            if g in ratios and it.output_len > 400:
                ratios[g].append(v / it.output_len)
    # The refined bound does not shrink monotonically: the q-quantile of a length known to exceed g grows with g,
    # so refinement mostly repairs the long calls' under-estimates: on the same calls (longer than 400 tokens)
    # coverage rises from g = 0 to g = 400.
    assert len(ratios[400]) >= 20
    assert np.mean(np.asarray(ratios[400]) >= 1.0) > np.mean(np.asarray(ratios[0]) >= 1.0)


def test_compound_calls_use_pattern_then_history_quantile(builtin_data):
    hist = pb.HistoryQuantiles(builtin_data, DEFAULT_QUANTILE)
    b = pb.PredictorBounder({}, hist)
    n, rid = 300, "j9.1.0"
    q0 = hist.bound("tot", 1, 0)
    assert q0 is not None and b.bound(n, 0, 0.0, ("compound", "tot", 1), rid) == q0
    assert b.bound(n, 120, 0.0, ("compound", "tot", 1), rid) == max(hist.bound("tot", 1, 100), 121)
    # the advisor matched patterns: their samples win, refined as the call generates, capped by max_tokens
    b.pattern[("j9", 1)] = StageLengthSamples(tuple(range(100, 200)), (), 0.9, 1)
    assert b.bound(n, 0, 0.0, ("compound", "tot", 1), rid) == 190
    assert b.bound(n, 160, 0.0, ("compound", "tot", 1), rid) == 195  # issued at 150: q0.9 of 151..199
    assert b.bound(n, 250, 0.0, ("compound", "tot", 1), rid) == max(hist.bound("tot", 1, 250) or 0, 251)
    b.pattern[("j9", 1)] = StageLengthSamples(tuple([5000] * 20), (), 0.9, 1)
    assert b.bound(n, 0, 0.0, ("compound", "tot", 1), rid) == pb.COMPOUND_MAX_TOKENS


def test_short_simulation_with_predictor_bounds(source, builtin_data):
    jobs = make_workload(40, 3.0, data=builtin_data, seed=4)
    st = RunSettings(length_bound="predictor", seed=3, waiting_time=None, give_up_after=None)  # all served
    analyzers: dict = {}
    r1 = run_sim_one(jobs, MODEL, "gmax", st, builtin_data, analyzers)
    r2 = run_sim_one(jobs, MODEL, "gmax", st, builtin_data, analyzers)
    r3 = run_sim_one(jobs, MODEL, "oracle", st, builtin_data, analyzers)
    assert r1["length_bound"] == "predictor" and r3["length_bound"] == "oracle"
    assert r1["token_goodput"] == r2["token_goodput"] and r1["steps"] == r2["steps"]
    prep = pb.prepare_predictor_run(jobs, builtin_data, seed=3, decode_s=DECODE_S, prefill_s=PREFILL_S)
    assert len(prep.prompts) == sum(j.kind in pb.SINGLE_KINDS for j in jobs)
    # every variant (the oracle too) ran the attached workload: all of its output tokens were generated
    attached = sum(j.total_tokens[1] for j in prep.jobs)
    assert attached != sum(j.total_tokens[1] for j in jobs)
    assert r1["output_tokens"] == r3["output_tokens"] == attached


def test_workloads_that_differ_only_in_their_slos_get_their_own_attachment(source, builtin_data):
    tight = make_workload(40, 4.0, data=builtin_data, seed=3, tightness=0.5)
    loose = make_workload(40, 4.0, data=builtin_data, seed=3, tightness=2.0)
    kw = dict(seed=3, decode_s=DECODE_S, prefill_s=PREFILL_S)
    a = pb.prepare_predictor_run(tight, builtin_data, **kw)
    b = pb.prepare_predictor_run(loose, builtin_data, **kw)
    assert a is not b
    assert [j.deadline for j in a.jobs] == [j.deadline for j in tight]
    assert [j.deadline for j in b.jobs] == [j.deadline for j in loose]


def test_bound_quality_scores_the_bounds_a_run_serves(source, builtin_data):
    from jitflow_server.bench.estimates import CompoundAnalyzer

    jobs = make_workload(60, 3.0, data=builtin_data, seed=5)
    prep = pb.prepare_predictor_run(jobs, builtin_data, seed=5, decode_s=DECODE_S, prefill_s=PREFILL_S)
    q = pb.bound_quality(prep, CompoundAnalyzer("pattern", builtin_data, DECODE_S, PREFILL_S), ks=(0, 100))
    assert {"single", "compound"} <= set(q)
    for group in q.values():
        for s in group.values():
            assert s["n"] > 0 and 0.0 <= s["coverage"] <= 1.0 and s["p90_ratio"] >= s["median_ratio"] > 0
    # every compound call is counted once at k = 0, split by where its bound came from
    n_compound = sum(len(c) for j in prep.jobs if j.kind not in pb.SINGLE_KINDS for c in j.stages)
    assert q["compound"]["0"]["n"] == n_compound
    assert sum(q.get(g, {}).get("0", {}).get("n", 0) for g in ("compound_pattern", "compound_quantile")) == n_compound
