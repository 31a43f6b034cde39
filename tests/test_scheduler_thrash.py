"""Regression: under overload GMAX must not rotate its batch among late requests (δ clock).

Found in the simulator (docs/benchmarks.md): counting δ's frames since a request was last served
lets every waiting request outrank the running ones after one frame once most requests are late,
and the batch rotates with a recompute preemption each time. Counting from arrival (the default)
keeps old running requests ahead.
"""

from __future__ import annotations

from test_sim_engine import _run, _workload


def test_age_clock_avoids_recompute_thrashing_under_overload():
    jobs = _workload(n=80, rps=20.0, seed=5)  # far beyond the small engine's capacity
    age = _run(jobs, starvation_clock="arrival")
    served = _run(jobs, starvation_clock="served")
    assert served["preemptions"] > 0  # the scenario does provoke the rotation
    assert age["preemptions"] * 2 < served["preemptions"], (age["preemptions"], served["preemptions"])
