"""Schema-driven fuzzing (schemathesis + hypothesis) of every HTTP endpoint the server documents in its
OpenAPI schema, against a real HTTP server on 127.0.0.1 around the FakeEngine: no input may get a 5xx,
and every 4xx is in OpenAI's error shape."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from jitflow_server.engine.fake import FakeEngine
from test_api_fake_engine import serve

#: Examples per operation (each one HTTP request). Enough to hit the validators' edges; bounded so the suite
#: stays fast.
EXAMPLES = 30


pytestmark = pytest.mark.usefixtures("env")


@pytest.fixture()
def api_schema():
    with serve(FakeEngine(eos_after=3)) as (url, _):
        r = httpx.post(url + "/v1/tasks", json={"task_id": TASK_ID, "app": "fuzz", "deadline": 3600}, timeout=10)
        assert r.status_code == 201, r.text
        yield schemathesis.openapi.from_url(url + "/openapi.json")


#: A task that exists, so that the task endpoints' bodies are validated rather than answered 404.
TASK_ID = "fuzz-task"


def _check(case, seen: dict[str, int]) -> None:
    # Steer the fuzzer past the two cheapest refusals (unknown model, unknown task) into the validators.
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "fake"
    if case.path_parameters and "task_id" in case.path_parameters:
        case.path_parameters["task_id"] = TASK_ID
    response = case.call(timeout=30)
    seen[f"{case.method} {case.path} {response.status_code}"] = seen.get(f"{case.method} {case.path} {response.status_code}", 0) + 1
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        err = response.json().get("error")
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, response.text[:500]
        assert isinstance(err["message"], str) and err["message"]
        assert err["code"] is None or isinstance(err["code"], str)


def test_no_input_gets_a_server_error(api_schema):
    """Every documented operation, ``EXAMPLES`` generated requests each (schemathesis's strategies driven by
    hypothesis directly: its pytest plugin does not run under this pytest)."""
    ops = [r.ok() for r in api_schema.get_all_operations()]
    # Pausing the engine would stall every later example for its waiting time; it is tested directly.
    ops = [op for op in ops if not op.path.endswith(("/engine/pause", "/engine/resume"))]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/tasks", "/v1/tasks/{task_id}/events"} <= {
        op.path for op in ops}
    seen: dict[str, int] = {}
    for op in ops:
        def run(case) -> None:
            _check(case, seen)

        given(case=op.as_strategy())(settings(max_examples=EXAMPLES, deadline=None, database=None,
                                              suppress_health_check=list(HealthCheck))(run))()
    print(sorted(seen.items()))
    assert sum(seen.values()) >= len(ops) * EXAMPLES // 2, seen  # the fuzzer did send requests
    assert any(" 200" in k for k in seen) and any(" 400" in k for k in seen), seen
