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
