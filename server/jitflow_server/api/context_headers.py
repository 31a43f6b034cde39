"""SLO and task context from HTTP headers, for clients that cannot add body fields.

The official OpenAI client sends jitflow's body fields through ``extra_body``; a client library or proxy
that forwards only standard bodies can send the same context as headers (``extra_headers`` in the
OpenAI client, or a gateway's header rules). Body fields win over headers.

| header | body field |
|---|---|
| ``x-jitflow-slo-kind`` | ``slo.kind`` |
| ``x-jitflow-ttft``, ``x-jitflow-tbt``, ``x-jitflow-deadline``, ``x-jitflow-waiting-time`` | ``slo.*`` (s) |
| ``x-jitflow-task-id``, ``x-jitflow-app``, ``x-jitflow-stage``, ``x-jitflow-stage-index``, ``x-jitflow-call-id`` | ``jitflow.*`` |
| ``x-jitflow-parents`` (comma-separated call ids) | ``jitflow.parents`` |

A header that does not validate is a 400 naming it (``param`` = the header name).
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import ValidationError

from jitflow_server.api.schemas import SLO, APIError, TaskContext

SLO_HEADERS = {"x-jitflow-slo-kind": "kind", "x-jitflow-ttft": "ttft", "x-jitflow-tbt": "tbt",
               "x-jitflow-deadline": "deadline", "x-jitflow-waiting-time": "waiting_time"}
TASK_HEADERS = {"x-jitflow-task-id": "task_id", "x-jitflow-app": "app", "x-jitflow-stage": "stage",
                "x-jitflow-stage-index": "stage_index", "x-jitflow-call-id": "call_id",
                "x-jitflow-parents": "parents"}
_NUMBERS = {"ttft", "tbt", "deadline", "waiting_time"}


def _parse(model, names: dict[str, str], headers: Mapping[str, str]):
    given = {h: field for h, field in names.items() if h in headers}  # header -> field, those sent
    if not given:
        return None
    values: dict = {}
    for header, field in given.items():
        text = headers[header]
        if field in _NUMBERS:
            try:
                values[field] = float(text)
            except ValueError:
                raise APIError(400, f"header {header} must be a number of seconds, got {text!r}",
                               param=header) from None
        elif field == "parents":
            values[field] = [p.strip() for p in text.split(",") if p.strip()]
        else:
            values[field] = text
    try:
        return model.model_validate(values, strict=False)  # header values are strings: "2" is stage 2
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err.get("loc") else None
        header = next((h for h, f in given.items() if f == field), next(iter(given)))
        raise APIError(400, f"header {header}: {err['msg']}", param=header) from None


def context_from_headers(headers: Mapping[str, str]) -> tuple[SLO | None, TaskContext | None]:
    """The ``slo`` and ``jitflow`` objects the request's headers carry (``None`` where none is set).
    ``headers`` is case-insensitive (Starlette's ``Request.headers``). Raises ``APIError(400)`` naming
    the header that does not validate."""
    return _parse(SLO, SLO_HEADERS, headers), _parse(TaskContext, TASK_HEADERS, headers)
