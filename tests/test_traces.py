"""Trace replay (bench/traces.py) and the simulator's cross-request prefix cache (engine/sim_run.py)."""

from __future__ import annotations

import gzip
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pytest

from jitflow_server.bench.traces import Trace, load_trace, trace_workload
from jitflow_server.bench.workload import (
    DataSources,
    WorkloadError,
    default_data_dir,
    load_azure_trace,
    make_workload,
    rescale_prefix_ids,
)
from jitflow_server.engine.jobs import CallSpec, Job
from jitflow_server.engine.sim import SimConfig, SimEngine
from jitflow_server.engine.step_model import StepModel
from jitflow_server.scheduler import make_policy

SMALL = StepModel(name="test", base_s=0.01, per_decode_s=0.0005, per_prefill_token_s=0.0002, per_ctx_token_s=1e-7,
                  hetero=0.1, kv_capacity_tokens=200_000, block_size=16, max_batched_tokens=1024,
                  sarathi_chunk=256, batch_size=8)
AZURE_CONV = Path("azure_llm_2023/AzureLLMInferenceTrace_conv.csv")


class _Exact:
    """Length bounds equal to the truth (keeps these tests independent of the estimator)."""

    refine_every = 50

    def bound(self, true_len: int, generated: int, z: float, cls: tuple, rid: str) -> int:
        return true_len


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _simulate(jobs: list[Job], model: StepModel = SMALL, policy: str = "fcfs") -> dict:
    eng = SimEngine(model, make_policy(policy, delta_steps=50), _Exact(), None, SimConfig(waiting_time=None))
    out = eng.run(jobs)
    for k in ("wall_s", "frame_ms", "match_ms"):
        out.pop(k)
    return out


def _strip(jobs: list[Job]) -> list[Job]:
    return [Job(j.job_id, j.kind, j.arrival, j.app, [[CallSpec(c.input_len, c.output_len) for c in s]
                                                     for s in j.stages],
                j.ttft, j.tbt, j.deadline, j.tool_time) for j in jobs]


def _fingerprint(jobs: list[Job]) -> str:
    ser = [(j.job_id, j.kind, j.arrival, j.app, [[(c.input_len, c.output_len) for c in s] for s in j.stages],
            j.ttft, j.tbt, j.deadline, j.tool_time) for j in jobs]
    return hashlib.sha256(repr(ser).encode()).hexdigest()[:16]


def _shared_prefix_trace(tmp_path: Path, n: int = 24, gap_ms: int = 500) -> Path:
    """``n`` prompts of 2,000 tokens (4 blocks): 3 blocks of a common system prompt, one own block."""
    rows = [{"timestamp": i * gap_ms, "input_length": 2000, "output_length": 20,
             "hash_ids": [7, 8, 9, 1000 + i]} for i in range(n)]
    return _jsonl(tmp_path / "shared.jsonl", rows)


# ------------------------------------------------------------------------------------------ parsing
def test_mooncake_jsonl_is_parsed_sorted_and_in_seconds(tmp_path):
    p = tmp_path / "mc.jsonl"
    p.write_text("\n".join([
        json.dumps({"timestamp": 1000, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}),
        "",
        json.dumps({"timestamp": 500.5, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}),
        json.dumps({"timestamp": 3000, "input_length": 12.0, "output_length": 0}),  # no hash_ids
    ]) + "\n\n")
    tr = load_trace(p)
    assert tr.format == "mooncake" and tr.origin == str(p) and len(tr) == 3
    np.testing.assert_allclose(tr.arrival_s, [0.0, 0.4995, 2.4995])
    assert tr.input_len.tolist() == [1100, 600, 12] and tr.input_len.dtype == np.int64
    assert tr.output_len.tolist() == [5, 10, 0]
    assert tr.hash_ids == [(1, 2, 3), (1, 2), ()]
    assert tr.mean_rps == pytest.approx(2 / 2.4995)
    assert tr.without_prefixes().hash_ids is None
    nohash = _jsonl(tmp_path / "nohash.jsonl", [{"timestamp": 0, "input_length": 5, "output_length": 5}])
    assert load_trace(nohash).hash_ids is None


def test_azure_csv_is_parsed_and_shared_with_load_azure_trace(tmp_path):
    p = tmp_path / "azure.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:50.9951690,396,109\n"
                 "\n"
                 "2023-11-16 18:15:48.0000000,879,1\n")  # out of order: sorted
    tr = load_trace(p)
    assert tr.format == "azure" and tr.hash_ids is None
    np.testing.assert_allclose(tr.arrival_s, [0.0, 1.31941, 4.314579], atol=1e-6)
    assert tr.input_len.tolist() == [374, 879, 396] and tr.output_len.tolist() == [44, 1, 109]
    t, pairs = load_azure_trace(p)
    np.testing.assert_array_equal(t, tr.arrival_s)
    assert pairs.tolist() == [[374, 44], [879, 1], [396, 109]]
    with pytest.raises(WorkloadError, match="not an Azure"):
        load_azure_trace(_jsonl(tmp_path / "x.jsonl", [{"timestamp": 0, "input_length": 5, "output_length": 5}]))


def test_gzip_trace_is_read(tmp_path):
    p = tmp_path / "mc.jsonl.gz"
    with gzip.open(p, "wt") as fh:
        fh.write(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 6}) + "\n")
    assert load_trace(p).input_len.tolist() == [5]


@pytest.mark.parametrize("text, where", [
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, "output_length": 1}\n',
     ":2: field 'input_length': missing"),
    ('{"timestamp": 0, "input_length": -5, "output_length": 1}\n', ":1: field 'input_length': negative"),
    ('\n\n{"timestamp": 0, "input_length": 5, "output_length": 2.5}\n', ":3: field 'output_length'"),
    ('{"timestamp": 0, "input_length": 5, "output_length": true}\n', ":1: field 'output_length'"),
    ('{"timestamp": 0, "input_length": "abc", "output_length": 1}\n', ":1: field 'input_length'"),
    ('{"timestamp": NaN, "input_length": 5, "output_length": 1}\n', ":1: field 'timestamp': expected a finite"),
    ('{"timestamp": "soon", "input_length": 5, "output_length": 1}\n', ":1: field 'timestamp'"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "x"]}\n', ":1: field 'hash_ids': item 1"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 3}\n', ":1: field 'hash_ids'"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1,\n', ":2: invalid JSON"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n[1, 2]\n', ":2: expected a JSON object"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,5\n2023-11-16 18:15:47.1,-3,5\n",
     ":3: field 'ContextTokens': negative"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10\n", ":2: field 'GeneratedTokens': missing"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,5\n", ":2: field 'TIMESTAMP'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,1e400,5\n", ":2: field 'ContextTokens'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,5.5\n", ":2: field 'GeneratedTokens'"),
    ("time,prompt,output\n1,2,3\n", ":1: unknown trace format"),
    ("\n\nhello world\n", ":3: unknown trace format"),
])
def test_bad_rows_name_the_line_and_field(tmp_path, text, where):
    p = tmp_path / "bad.txt"
    p.write_text(text)
    with pytest.raises(WorkloadError) as e:
        load_trace(p)
    assert str(p) + where in str(e.value)


def test_empty_missing_and_binary_files_are_rejected(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.csv").write_text("\n  \n\n")
    for name in ("empty.jsonl", "blank.csv"):
        with pytest.raises(WorkloadError, match="empty trace file"):
            load_trace(tmp_path / name)
    (tmp_path / "header_only.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(WorkloadError, match="no rows"):
        load_trace(tmp_path / "header_only.csv")
    with pytest.raises(WorkloadError, match="cannot read"):
        load_trace(tmp_path / "absent.jsonl")
    with pytest.raises(WorkloadError, match="cannot read"):
        load_trace(tmp_path)
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(WorkloadError, match="not UTF-8"):
        load_trace(tmp_path / "bin.dat")


def test_large_trace_loads_quickly(tmp_path):
    rng = np.random.default_rng(0)
    p = tmp_path / "big.jsonl"
    n = 50_000
    ins = rng.integers(1, 8000, n)
    with open(p, "w") as fh:
        for i in range(n):
            nb = -(-int(ins[i]) // 512)
            fh.write(json.dumps({"timestamp": i * 200, "input_length": int(ins[i]), "output_length": 100,
                                 "hash_ids": list(range(i % 7 * 100, i % 7 * 100 + nb))}) + "\n")
    t0 = time.perf_counter()
    tr = load_trace(p)
    assert time.perf_counter() - t0 < 5.0  # ~0.2 s here; generous for a busy machine
    assert len(tr) == n and tr.mean_rps == pytest.approx(5.0)


def test_real_azure_conv_trace_loads():
    d = default_data_dir()
    if d is None or not (d / AZURE_CONV).exists():
        pytest.skip("Azure conv trace not available")
    tr = load_trace(d / AZURE_CONV)
    assert tr.format == "azure" and len(tr) == 19_366
    assert tr.mean_rps == pytest.approx(5.53, abs=0.01)
    assert int(tr.input_len.max()) == 14_050


# ------------------------------------------------------------------------------------------ workload
def _rows(n: int, seed: int = 1) -> Trace:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(0.3, n))
    ins = rng.integers(10, 3000, n)
    return Trace(t - t[0], ins, rng.integers(1, 500, n), [tuple(range(-(-int(i) // 512))) for i in ins],
                 "mem", "mooncake")


def test_rescale_hits_the_requested_rate_and_keeps_the_shape():
    tr = _rows(500)
    for rps in (0.5, 7.0, 40.0):
        jobs = trace_workload(tr, rps=rps)
        arr = np.array([j.arrival for j in jobs])
        assert arr[0] == 0.0 and np.all(np.diff(arr) >= 0)
        assert (len(jobs) - 1) / arr[-1] == pytest.approx(rps)
        np.testing.assert_allclose(arr / arr[-1], tr.arrival_s / tr.arrival_s[-1])  # gaps in proportion
    own = trace_workload(tr)
    np.testing.assert_array_equal([j.arrival for j in own], tr.arrival_s)
    head = trace_workload(tr, rps=3.0, limit=100)
    assert len(head) == 100 and 99 / head[-1].arrival == pytest.approx(3.0)
    assert trace_workload(tr, limit=0) == []
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(WorkloadError, match="rps"):
            trace_workload(tr, rps=bad)
    with pytest.raises(WorkloadError, match="limit"):
        trace_workload(tr, limit=-1)
    with pytest.raises(WorkloadError, match="mix"):
        trace_workload(tr, mix=(0, 0, 0))
    with pytest.raises(WorkloadError, match="max_context"):
        trace_workload(tr, max_context=1)


def test_kind_mix_slos_and_row_lengths():
    tr = _rows(400)
    jobs = trace_workload(tr, mix=(2, 1, 1), seed=3, tightness=0.5)
    kinds = [j.kind for j in jobs]
    assert (kinds.count("latency"), kinds.count("deadline"), kinds.count("compound")) == (200, 100, 100)
    assert kinds != sorted(kinds)  # shuffled
    for i, j in enumerate(jobs):
        assert j.job_id == f"j{i}" and j.arrival == tr.arrival_s[i]
        if j.kind == "compound":
            assert j.app in ("deep-research", "tot") and len(j.stages) >= 4
            assert j.deadline == pytest.approx(20.0 * len(j.stages) * 0.5)
            assert all(c.prefix_ids is None for s in j.stages for c in s)
            continue
        (c,), = j.stages
        assert (c.input_len, c.output_len) == (tr.input_len[i], tr.output_len[i])
        assert c.prefix_ids == tr.hash_ids[i]
        if j.kind == "latency":
            assert (j.app, j.ttft, j.tbt, j.deadline) == ("chat", 1.0, 0.05, None)
        else:
            assert (j.app, j.deadline, j.ttft) == ("batch", 10.0, None)
    apps = [j.app for j in jobs if j.kind == "compound"]
    assert apps[0::2] == ["deep-research"] * 50 and apps[1::2] == ["tot"] * 50
    assert [j.kind for j in trace_workload(tr, mix=(0, 1, 0))] == ["deadline"] * 400
    assert _fingerprint(trace_workload(tr, seed=3)) == _fingerprint(trace_workload(tr, seed=3))
    assert _fingerprint(trace_workload(tr, seed=3)) != _fingerprint(trace_workload(tr, seed=4))


def test_length_scale_context_cap_and_prefix_reblocking():
    tr = Trace(np.array([0.0]), np.array([0]), np.array([3000]), [(5, 6, 7, 8, 9, 10)], "mem", "mooncake")
    (c,), = trace_workload(tr, mix=(1, 0, 0), max_context=1024)[0].stages
    assert (c.input_len, c.output_len) == (1, 1023) and c.prefix_ids == (5,)  # ≥ 1 token, capped
    assert rescale_prefix_ids((1, 2, 3, 4), 1.0, 1100) == (1, 2, 3)
    half = rescale_prefix_ids((1, 2, 3, 4), 0.5, 1024)  # scaled block j covers original 2j, 2j+1
    assert half == (hash((1, 2)), hash((3, 4)))
    assert rescale_prefix_ids((1, 2, 3, 4), 0.5, 1024)[0] == rescale_prefix_ids((1, 2, 9), 0.5, 1024)[0]
    assert rescale_prefix_ids((1, 2, 3, 4), 0.5, 1024)[1] != rescale_prefix_ids((1, 2, 9), 0.5, 1024)[1]
    assert rescale_prefix_ids((1, 2), 2.0, 2048) == (hash((1,)), hash((1,)), hash((2,)), hash((2,)))


def test_make_workload_output_is_unchanged_by_the_refactor():
    # fingerprints computed with make_workload before JobFactory was factored out of it
    b = DataSources.load(None)
    jobs = make_workload(200, 2.0, seed=5, mix=(1, 2, 3), tightness=0.7, data=b, length_scale=0.5, max_context=1500)
    assert _fingerprint(jobs) == "d4a0bab7461e0601"
    d = default_data_dir()
    if d is None or not (d / AZURE_CONV).exists() or not (d / "deepresearch/deepresearch_training.json").exists():
        pytest.skip("shared data not available")
    assert _fingerprint(make_workload(200, 2.0, seed=5, arrivals="azure", data=DataSources.load(d))) == \
        "9ebb2326459dc363"


# ------------------------------------------------------------------------------------------ simulator
def test_shared_prefixes_cut_prefill(tmp_path):
    tr = load_trace(_shared_prefix_trace(tmp_path))
    jobs = trace_workload(tr, mix=(0, 1, 0))
    inputs = sum(j.total_tokens[0] for j in jobs)
    cached = _simulate(jobs)
    plain = _simulate(trace_workload(tr.without_prefixes(), mix=(0, 1, 0)))
    assert plain["prefill_tokens"] == inputs and plain["prefix_hit_tokens"] == 0
    assert cached["preemptions"] == 0
    # every call after the first skips the 3 shared 512-token blocks (1,536 tokens, block-aligned)
    assert cached["prefix_hit_tokens"] == 23 * 1536
    assert cached["prefill_tokens"] == inputs - 23 * 1536
    assert cached["makespan"] <= plain["makespan"]
    assert [r["output_tokens"] for r in cached["jobs"]] == [20] * 24
    off = StepModel(**{**SMALL.to_dict(), "prefix_caching": False})
    assert _simulate(jobs, model=off)["prefill_tokens"] == inputs


def test_prefix_hits_need_the_same_preceding_blocks_and_leave_the_last_token():
    def job(i, t, ids, n=2000):
        return Job(f"j{i}", "deadline", t, "batch", [[CallSpec(n, 5, ids)]], deadline=100.0)
    # j1 shares block 1's id with j0 but not block 0: no hit; j2 repeats j0's prompt: all but the last
    # token's 16-token block; j3 shares j0's first block only
    jobs = [job(0, 0.0, (1, 2, 3, 4)), job(1, 2.0, (9, 2, 3, 4)), job(2, 4.0, (1, 2, 3, 4)),
            job(3, 6.0, (1, 5, 6, 7))]
    out = _simulate(jobs)
    assert out["prefix_hit_tokens"] == 1984 + 512
    assert out["prefill_tokens"] == 4 * 2000 - 1984 - 512


def test_prefix_cache_is_bounded_by_the_kv_capacity():
    small = StepModel(**{**SMALL.to_dict(), "kv_capacity_tokens": 4096})  # 8 prefix blocks
    jobs = [Job(f"j{i}", "deadline", 2.0 * i, "batch", [[CallSpec(2048, 5, ids)]], deadline=100.0)
            for i, ids in enumerate([(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12), (1, 2, 3, 4)])]
    assert _simulate(jobs, model=small)["prefix_hit_tokens"] == 0  # (1..4) evicted (LRU) by the two others
    assert _simulate(jobs)["prefix_hit_tokens"] == 2032


@pytest.mark.parametrize("policy", ["fcfs", "sjf"])
def test_without_hash_ids_results_are_identical(tmp_path, policy):
    tr = _rows(120, seed=5)
    jobs = trace_workload(tr, rps=6.0, mix=(1, 1, 0), seed=2)
    tight = StepModel(**{**SMALL.to_dict(), "kv_capacity_tokens": 12_000})  # preemptions on
    stripped = _simulate(_strip(jobs), model=tight, policy=policy)
    assert stripped["preemptions"] > 0 and stripped["prefix_hit_tokens"] == 0
    assert _simulate(trace_workload(tr.without_prefixes(), rps=6.0, mix=(1, 1, 0), seed=2), model=tight,
                     policy=policy) == stripped
    # ids present but prefix caching off: the ids are ignored, nothing else changes
    off = StepModel(**{**tight.to_dict(), "prefix_caching": False})
    assert _simulate(jobs, model=off, policy=policy) == _simulate(_strip(jobs), model=off, policy=policy)
    # ids that no two calls share, no preemption: no hit, the same run
    uniq = [Job(j.job_id, j.kind, j.arrival, j.app,
                [[CallSpec(c.input_len, c.output_len, tuple(range(k * 100, k * 100 + 6))) for c in s]
                 for s in j.stages], j.ttft, j.tbt, j.deadline) for k, j in enumerate(jobs)]
    assert _simulate(uniq, policy=policy) == _simulate(_strip(jobs), policy=policy)
