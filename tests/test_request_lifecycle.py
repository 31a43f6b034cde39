"""The request state machine shared by the vLLM plug-in and the simulator (scheduler/lifecycle.py)."""

from __future__ import annotations

import pytest

from jitflow_server.scheduler.lifecycle import TRANSITIONS, IllegalTransition, Lifecycle, RequestState

S = RequestState


def test_admission_preemption_and_finish_milestones():
    life = Lifecycle(arrival=10.0)
    assert life.admit_by(5.0) == 15.0 and not life.ever_scheduled
    life.to(S.RUNNING, 11.0)
    assert life.first_scheduled == 11.0 and life.admit_by(5.0) is None
    life.tokens(11.5)
    life.to(S.PREEMPTED, 12.0)
    life.to(S.RUNNING, 13.0)
    life.tokens(14.0)
    assert life.first_scheduled == 11.0 and life.preemptions == 1
    assert (life.first_token, life.last_token) == (11.5, 14.0)
    life.to(S.FINISHED, 14.0)
    assert life.done and life.ended == 14.0


def test_rejection_only_before_the_first_schedule():
    life = Lifecycle(arrival=0.0)
    life.to(S.REJECTED, 5.0)
    assert life.done and life.state is S.REJECTED
    ran = Lifecycle(arrival=0.0)
    ran.to(S.RUNNING, 1.0)
    ran.to(S.PREEMPTED, 2.0)
    with pytest.raises(IllegalTransition):
        ran.to(S.REJECTED, 3.0)


@pytest.mark.parametrize("terminal", [S.FINISHED, S.ABORTED, S.REJECTED])
def test_terminal_states_have_no_way_out(terminal):
    assert TRANSITIONS[terminal] == frozenset()
    life = Lifecycle(arrival=0.0, state=terminal)
    for s in S:
        if s is not terminal:
            with pytest.raises(IllegalTransition):
                life.to(s, 1.0)


def test_same_state_is_a_no_op_and_waiting_cannot_finish_without_running():
    life = Lifecycle(arrival=0.0)
    life.to(S.WAITING, 1.0)
    assert life.state is S.WAITING
    with pytest.raises(IllegalTransition):
        life.to(S.FINISHED, 1.0)
    with pytest.raises(IllegalTransition):
        life.to(S.PREEMPTED, 1.0)
