"""The chaos benchmark's fuzz steering: generated bodies reach the validators and the engine, and every
generation endpoint (chat, completions, Responses) is capped so 10 000 requests finish in minutes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jitflow_server.bench.chaos_fuzz import steer


def case(path: str, body: dict) -> SimpleNamespace:
    return SimpleNamespace(path=path, body=body, path_parameters=None)


@pytest.mark.parametrize(("path", "field"), [("/v1/chat/completions", "max_tokens"),
                                             ("/v1/completions", "max_tokens"),
                                             ("/v1/responses", "max_output_tokens")])
def test_generation_lengths_are_capped_and_set_when_absent(path, field):
    c = case(path, {"model": "x", field: 5000})
    steer(c, model="demo", task_id="t", cap=16)
    assert c.body == {"model": "demo", field: 16}
    c = case(path, {"model": "x"})
    steer(c, model="demo", task_id="t", cap=16)
    assert c.body[field] == 16
    c = case(path, {"model": "x", field: -3})  # out of range: sent as generated, for the validators
    steer(c, model="demo", task_id="t", cap=16)
    assert c.body[field] == -3
    c = case(path, {"model": "x"})  # a cap below OpenAI's least max_output_tokens is raised to it there
    steer(c, model="demo", task_id="t", cap=8)
    assert c.body[field] == (16 if path == "/v1/responses" else 8)


def test_task_ids_name_an_existing_task_and_other_bodies_keep_their_fields():
    c = SimpleNamespace(path="/v1/tasks/{task_id}/events", body={"events": []}, path_parameters={"task_id": "zz"})
    steer(c, model="demo", task_id="known", cap=16)
    assert c.path_parameters["task_id"] == "known" and c.body == {"events": []}
