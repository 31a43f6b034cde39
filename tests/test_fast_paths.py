"""The hand-written fast paths of the frame loop against the numpy calls they replace, bit for bit.

Each of them exists only because it is cheaper per call (the simulator calls them hundreds of thousands
of times a run); a result that differs in the last bit would change decisions, so equality is exact.
"""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jitflow_server.engine.step_model import cv
from jitflow_server.scheduler.snapshot import COMPOUND, StageGroups, build_snapshot, dense_rank
from jitflow_server.scheduler.synthetic import synthetic_views
from jitflow_server.scheduler.types import SchedContext, TokenTimeModel

_ints = hnp.arrays(np.int64, st.integers(1, 60), elements=st.integers(0, 49))


@settings(max_examples=200, deadline=None)
@given(_ints)
def test_dense_rank_is_np_unique_inverse(values):
    inverse, count = dense_rank(values, 50)
    uniq, expected = np.unique(values, return_inverse=True)
    np.testing.assert_array_equal(inverse, expected)
    assert count == uniq.size


@settings(max_examples=200, deadline=None)
@given(_ints, st.integers(1, 4), st.data())
def test_stage_group_max_is_ufunc_at(values, rows, data):
    group, n_groups = dense_rank(values, 50)
    x = data.draw(hnp.arrays(np.float64, (rows, group.size),
                             elements=st.floats(-1e6, 1e6) | st.sampled_from([np.nan, np.inf, -np.inf])))
    expected = np.full((rows, n_groups), -np.inf)
    with np.errstate(invalid="ignore"):
        for r in range(rows):
            np.maximum.at(expected[r], group, x[r])
    got = StageGroups.of(np.arange(group.size), group, n_groups).max(x)
    np.testing.assert_array_equal(got, expected)


def test_snapshot_stage_groups_index_the_compound_calls():
    snap = build_snapshot(synthetic_views(300, batch_size=32, seed=5))
    sg = snap.stage_groups
    assert sg is not None and sg.members.size > 10
    np.testing.assert_array_equal(sg.members, np.flatnonzero(snap.kind == COMPOUND))
    np.testing.assert_array_equal(sg.group, snap.group[sg.members])
    assert snap.n_groups == np.unique(sg.group).size
    np.testing.assert_array_equal(sg.max(sg.members.astype(float)),
                                  [sg.members[sg.group == g].max() for g in range(snap.n_groups)])


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(np.float64, st.integers(0, 300), elements=st.floats(0.0, 1e5)))
def test_cv_is_numpy_std_over_mean(x):
    m = float(x.mean()) if x.size else 0.0
    expected = float(x.std() / m) if x.size >= 2 and m > 0 else 0.0
    assert cv(x) == expected


def test_resized_context_is_dataclasses_replace():
    ctx = SchedContext(now=12.5, batch_size=64, token_time=0.03, prefill_rate=9000.0, swap_rate=2e4,
                       kv_capacity_tokens=100_000, replica=2, max_running=128, prefix_caching=True,
                       kv_block_size=16, token_time_model=TokenTimeModel(0.01, 0.001, 0.005))
    got = ctx.resized(24, 0.02)
    assert got == replace(ctx, batch_size=24, token_time=0.02)
    # resized passes every field positionally: a new field must be added there (and here)
    assert [f.name for f in fields(ctx)] == ["now", "batch_size", "token_time", "prefill_rate", "swap_rate",
                                             "kv_capacity_tokens", "replica", "max_running", "prefix_caching",
                                             "kv_block_size", "token_time_model"]
