"""SLO classes: validation and wire serialisation."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

import jitflow


@pytest.mark.parametrize("bad", [0, -1, -0.5, math.nan, math.inf, -math.inf, True, "2", None, [1]])
@pytest.mark.parametrize(
    "make",
    [
        lambda v: jitflow.Deadline(deadline=v),
        lambda v: jitflow.Latency(ttft=v, tbt=0.1),
        lambda v: jitflow.Latency(ttft=1, tbt=v),
        lambda v: jitflow.Compound(deadline=v) if v is not None else jitflow.Deadline(deadline=v),
        lambda v: jitflow.BestEffort(waiting_time=v) if v is not None else jitflow.Latency(1, v),
    ],
)
def test_invalid_times_raise_value_error(make, bad):
    with pytest.raises(ValueError):
        make(bad)


def test_wire_shapes_and_positional_forms():
    assert jitflow.Deadline(20).to_wire() == {"kind": "deadline", "deadline": 20.0}
    assert jitflow.Latency(2, 0.1).to_wire() == {"kind": "latency", "ttft": 2.0, "tbt": 0.1}
    assert jitflow.Latency(ttft=2, tbt=0.1) == jitflow.Latency(2, 0.1)
    assert jitflow.BestEffort(waiting_time=5).to_wire() == {"kind": "best_effort", "waiting_time": 5.0}
    assert jitflow.Compound().to_wire() == {"kind": "compound"}
    assert jitflow.Deadline(3).with_waiting_time(1.5).to_wire() == {
        "kind": "deadline", "deadline": 3.0, "waiting_time": 1.5,
    }
    with pytest.raises(ValidationError):
        jitflow.Deadline(3).with_waiting_time(0)
    with pytest.raises(ValidationError):
        jitflow.Deadline(3, extra_field=1)
    with pytest.raises(ValidationError):  # frozen
        jitflow.Deadline(3).deadline = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    "slo", [jitflow.Deadline(2), jitflow.Latency(1, 0.2, waiting_time=3), jitflow.BestEffort(), jitflow.Compound(7)]
)
def test_parse_roundtrip(slo):
    assert jitflow.parse_slo(slo.to_wire()) == slo
    assert jitflow.parse_slo(slo) is slo


def test_parse_errors_name_the_field():
    with pytest.raises(ValidationError) as ei:
        jitflow.parse_slo({"kind": "latency", "ttft": 1})
    assert any(err["loc"][-1] == "tbt" for err in ei.value.errors())
    with pytest.raises(ValidationError):
        jitflow.parse_slo({"kind": "fast"})
    with pytest.raises(TypeError):
        jitflow.parse_slo("deadline")
