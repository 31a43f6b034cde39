"""API keys and tenants: 401/403 in OpenAI's error shape, admin-only operator endpoints, tasks and pattern
history per tenant, the SDK and the OpenAI client authenticating. A real HTTP server on 127.0.0.1 around
the FakeEngine."""

from __future__ import annotations

import json
import time

import anyio
import httpx
import openai
import pytest
from typer.testing import CliRunner

import jitflow
from jitflow_server.api.auth import KeysError, load_keys
from jitflow_server.api.state import ServerSettings
from jitflow_server.cli import app as cli_app
from jitflow_server.engine.fake import FakeEngine
from jitflow_server.serve import is_loopback
from test_api_fake_engine import MSG, serve

pytestmark = pytest.mark.usefixtures("env")

ADMIN, ALICE, BOB = "admin-key-0123456789", "alice-key-0123456789", "bob-key-0123456789ab"


def _keys(tmp_path):
    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"keys": [{"key": ALICE, "tenant": "alice", "scope": "user"},
                                      {"key": BOB, "tenant": "bob"}]}))
    return load_keys(ADMIN, f)


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_keys_file_errors_name_the_entry(tmp_path):
    f = tmp_path / "k.json"
    for body, match in [({"keys": [{"key": "short", "tenant": "a"}]}, "at least 16"),
                        ({"keys": [{"key": ALICE, "tenant": "a/b"}]}, "tenant"),
                        ({"keys": [{"key": ALICE, "scope": "root"}]}, "scope"),
                        ({"keys": [{"key": ALICE}, {"key": ALICE}]}, "twice"),
                        ({"nokeys": 1}, "expected")]:
        f.write_text(json.dumps(body))
        with pytest.raises(KeysError, match=match):
            load_keys(None, f)
    f.write_text("{not json")
    with pytest.raises(KeysError, match="not JSON"):
        load_keys(None, f)
    assert load_keys(None, None) == {}


def test_missing_bad_and_insufficient_keys_get_openai_shaped_errors(tmp_path):
    eng = FakeEngine(eos_after=3)
    with serve(eng, ServerSettings(api_keys=_keys(tmp_path))) as (url, _):
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # public
        r = httpx.get(url + "/v1/models", timeout=10)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": {"message": "missing API key: send 'Authorization: Bearer <key>'",
                                      "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
        r = httpx.post(url + "/v1/chat/completions", headers=_h("wrong-key-0123456789"),
                       json={"model": "fake", "messages": MSG}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["message"] == "invalid API key"
        assert not eng.requests
        for method, path in [("post", "/v1/jitflow/policy"), ("post", "/v1/jitflow/engine/pause"),
                             ("get", "/v1/jitflow/engine"), ("get", "/v1/jitflow/engine/events")]:
            r = httpx.request(method, url + path, headers=_h(ALICE), json={"name": "fcfs"}, timeout=10)
            assert r.status_code == 403, path
            assert r.json()["error"]["code"] == "insufficient_scope"
        assert httpx.get(url + "/v1/jitflow/engine", headers=_h(ADMIN), timeout=10).status_code == 200
        r = httpx.post(url + "/v1/jitflow/policy", headers=_h(ADMIN), json={"name": "fcfs"}, timeout=10)
        assert r.status_code == 200, r.text
        assert httpx.get(url + "/v1/models", headers=_h(BOB), timeout=10).status_code == 200
        # a user key serves requests; the OpenAI client sends its api_key as a bearer key
        oa = openai.OpenAI(base_url=url + "/v1", api_key=ALICE, max_retries=0)
        assert oa.chat.completions.create(model="fake", messages=MSG, max_tokens=3).choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope-0123456789abcdef", max_retries=0).models.list()


def test_tasks_and_history_are_per_tenant(tmp_path):
    with serve(FakeEngine(eos_after=4), ServerSettings(api_keys=_keys(tmp_path))) as (url, state):
        async def run_alice() -> tuple[str, dict]:
            async with jitflow.AsyncClient(base_url=url, api_key=ALICE, model="fake") as alice:
                async with alice.task("shared-app", deadline=30) as task:
                    async with task.stage("s1") as st:
                        await st.chat(MSG, max_tokens=4)
                return task.task_id, await alice.get_task(task.task_id)

        tid, view = anyio.run(run_alice)
        assert view["app"] == "shared-app" and view["outcome"] == "succeeded"
        # bob can neither read nor extend alice's task, nor complete it
        with httpx.Client(base_url=url, headers=_h(BOB), timeout=10) as bob:
            assert bob.get(f"/v1/tasks/{tid}").status_code == 404
            r = bob.post(f"/v1/tasks/{tid}/events", json={"events": [{"type": "stage_start", "stage_index": 0,
                                                                       "time": time.time()}]})
            assert r.status_code == 404
            assert bob.post(f"/v1/tasks/{tid}/complete", json={"outcome": "failed"}).status_code == 404
            # the same task id under bob is a different task
            r = bob.post("/v1/tasks", json={"task_id": tid, "app": "shared-app", "deadline": 10})
            assert r.status_code == 201 and r.json()["outcome"] is None
        # alice's finished graph is history of alice's app only
        store = state.tasks.store
        assert store.count("alice/shared-app") == 1
        assert store.count("bob/shared-app") == 0 and store.count("shared-app") == 0


def test_serve_refuses_an_open_public_address(tmp_path):
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    r = CliRunner().invoke(cli_app, ["serve", "--host", "0.0.0.0", "--model", str(tmp_path / "none")])
    assert r.exit_code == 2 and "--insecure" in r.output
