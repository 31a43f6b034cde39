"""The typed scheduling-hints contract (scheduler/hints.py): validation, wire format, reserved keys."""

from __future__ import annotations

import json
import math

import pytest

from jitflow_server.scheduler import Kind
from jitflow_server.scheduler.hints import (
    HINTS_KEY,
    HINTS_VERSION,
    HintsError,
    HintUpdate,
    SchedHints,
    reserved_keys,
)


def test_round_trip_through_extra_args_keeps_every_field():
    h = SchedHints(kind=Kind.COMPOUND, request_id="r1", arrival=1.7e9, deadline=30.0, sub_deadline=-2.5,
                   waiting_time=5.0, task_id="t", stage_index=2, len_bound=120, task_tokens_est=9000,
                   task_rem_gen_time=4.5)
    xa = h.to_extra_args()
    assert list(xa) == [HINTS_KEY] and isinstance(xa[HINTS_KEY], str)
    back = SchedHints.from_extra_args(xa)
    assert back == h
    assert back.kind is Kind.COMPOUND and back.sub_deadline == -2.5


def test_engine_admission_travels_only_when_asked_for():
    # a front end that cannot ask the engine whether a call started sets it; other readers never see the field
    plain = SchedHints(kind="best_effort", waiting_time=5.0)
    assert "engine_admission" not in plain.to_dict()
    asked = plain.replace(engine_admission=True)
    assert asked.to_dict()["engine_admission"] is True
    assert SchedHints.from_extra_args(asked.to_extra_args()) == asked


def test_kind_given_as_string_is_coerced():
    assert SchedHints(kind="deadline", deadline=3).kind is Kind.DEADLINE


def test_absent_key_means_no_hints():
    assert SchedHints.from_extra_args(None) is None
    assert SchedHints.from_extra_args({"other": 1}) is None


@pytest.mark.parametrize("field, value", [
    ("deadline", -1.0), ("deadline", math.inf), ("ttft", 0.0), ("waiting_time", "soon"),
    ("len_bound", 0), ("len_bound", 2**40), ("len_bound", 1.5), ("stage_index", -1), ("task_rem_gen_time", math.nan),
    ("arrival", True), ("task_id", ""), ("engine_admission", 1), ("engine_admission", "yes"),
])
def test_invalid_field_is_named(field, value):
    kw = {"kind": "best_effort", field: value}
    with pytest.raises(HintsError) as ei:
        SchedHints(**kw)
    assert ei.value.field == field


def test_kind_requirements():
    with pytest.raises(HintsError) as ei:
        SchedHints(kind="latency", ttft=1.0)
    assert ei.value.field == "tbt"
    with pytest.raises(HintsError) as ei:
        SchedHints(kind="deadline")
    assert ei.value.field == "deadline"
    with pytest.raises(HintsError) as ei:
        SchedHints(kind="urgent")
    assert ei.value.field == "kind"


def test_wire_rejects_unknown_fields_other_versions_and_bad_json():
    ok = json.loads(SchedHints(kind="best_effort").to_json())
    with pytest.raises(HintsError) as ei:
        SchedHints.from_dict({**ok, "true_len": 10})  # the simulator's true length never crosses
    assert ei.value.field == "true_len"
    with pytest.raises(HintsError) as ei:
        SchedHints.from_dict({**ok, "version": HINTS_VERSION + 1})
    assert ei.value.field == "version"
    with pytest.raises(HintsError):
        SchedHints.from_dict({k: v for k, v in ok.items() if k != "version"})
    with pytest.raises(HintsError):
        SchedHints.from_extra_args({HINTS_KEY: "{not json"})
    with pytest.raises(HintsError):
        SchedHints.from_extra_args({HINTS_KEY: 5})


def test_reserved_keys_cover_hints_and_legacy_prefixes():
    assert reserved_keys({"jf_len_bound": 1, "jitflow_hints": "{}", "jitflow.x": 1, "foo": 2}) == [
        "jf_len_bound", "jitflow.x", "jitflow_hints"]
    assert reserved_keys(None) == []


def test_hint_update_validates_entries():
    u = HintUpdate.from_dict({"len_bound": {"a": 10}, "sub_deadline": {"a": -1.0}, "finished": [["b", 7]]})
    assert u.len_bound == {"a": 10} and u.sub_deadline == {"a": -1.0} and u.finished == (("b", 7.0),)
    assert HintUpdate.from_dict(u.to_dict()) == u
    with pytest.raises(HintsError):
        HintUpdate.from_dict({"len_bound": {"a": 0}})
