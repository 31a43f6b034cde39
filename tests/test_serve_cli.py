"""`jitflow serve` and `jitflow vllm-serve` check their policy parameters before any engine starts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from conftest import cli_text
from jitflow_server.cli import app


@pytest.mark.parametrize("command", ["serve", "vllm-serve"])
@pytest.mark.parametrize(("param", "message"), [
    ("future_margin=abc", "future_margin must be a number"),
    ("deadline_soft_share=2", "deadline_soft_share must be in [0, 1]"),
    ("no_such_knob=1", "no_such_knob"),
    ("future_margin", "must look like NAME=VALUE"),
])
def test_a_bad_policy_parameter_is_a_usage_error_naming_param(command, param, message):
    # a wrong parameter would otherwise fail inside the engine's start-up (vllm-serve: inside vLLM's process)
    r = CliRunner().invoke(app, [command, "--model", "tiny", "--policy", "gmax", "--param", param])
    text = cli_text(r.output)
    assert r.exit_code == 2, text
    assert "--param" in text and message in text


@pytest.mark.parametrize("command", ["serve", "vllm-serve"])
@pytest.mark.parametrize(("args", "hint", "message"), [
    (["--policy", "no-such-policy"], "--policy", "choose one of"),
    (["--policy", "oracle"], "--policy", "choose one of"),  # simulator-only: needs the true lengths
    (["--model", "/nonexistent/model-dir"], "--model", "/nonexistent/model-dir"),
])
def test_a_policy_no_engine_runs_or_a_missing_model_is_a_usage_error(command, args, hint, message):
    r = CliRunner().invoke(app, [command, "--model", "tiny", *args])
    text = cli_text(r.output)
    assert r.exit_code == 2, text
    assert hint in text and message in text
    if hint == "--policy":
        assert "gmax" in text and "oracle" not in text.split("choose one of", 1)[1]


def test_parameter_values_parse_as_json_or_infinity_else_stay_strings():
    from jitflow_server.bench.tune_cli import parse_grid
    from jitflow_server.serve import check_policy_params, parse_params

    got = parse_params(["admit_horizon=inf", "a=-INF", "b=Infinity", "c=3", "d=true", "e=goodput", "f=[1, 2]"])
    assert got == {"admit_horizon": float("inf"), "a": float("-inf"), "b": float("inf"), "c": 3, "d": True,
                   "e": "goodput", "f": [1, 2]}
    check_policy_params("gmax", {"admit_horizon": got["admit_horizon"]})  # reaches GMAX as a number
    assert parse_grid(["admit_horizon=2,inf", "window=paper, protected"]) == {
        "admit_horizon": [2, float("inf")], "window": ["paper", "protected"]}
