"""Helpers shared by the example apps: structured-output calls, task reports, CLI plumbing.

Only the public SDK (``import jitflow``) is used. The demo model's text is noise, so every
LLM output that drives control flow is requested with a JSON schema (``response_format``,
passed through to vLLM's structured-output backend); loops are bounded by counts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio

import jitflow

__all__ = [
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "EXIT_DEADLINE",
    "JSONResult",
    "StageReport",
    "TaskReport",
    "chat_json",
    "chat_text",
    "jitflow_error",
    "task_report",
    "fetch_server_view",
    "print_task_report",
    "add_common_args",
    "check_server",
    "exit_code",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_DEADLINE = 3

@dataclass
class JSONResult:
    """One structured-output LLM call.

    Attributes:
        data: the parsed JSON object, or ``default`` when the output was not valid JSON
            (e.g. cut off by ``max_tokens``).
        valid: whether ``data`` came from the model (True) or from ``default`` (False).
        output_tokens: generated tokens (tokens).
    """

    data: dict[str, Any]
    valid: bool
    output_tokens: int = 0


def json_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI ``response_format`` object for a JSON schema (vLLM structured output)."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def parse_json_object(text: str | None, default: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Parse ``text`` as a JSON object; return ``(default copy, False)`` if it is not one."""
    if text:
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            return obj, True
    return json.loads(json.dumps(default)), False


#: Temperature of the agents' calls unless a call says otherwise: greedy decoding, so a task makes the same
#: calls and decisions on every run and under every scheduler (the demo compares schedulers on identical
#: work). A per-call ``seed`` would do the same on a GPU; vLLM's CPU worker crashes on seeded requests.
DEFAULT_TEMPERATURE = 0.0


async def chat_json(
    st: jitflow.Stage,
    messages: list[dict[str, Any]],
    schema: dict[str, Any],
    *,
    name: str,
    max_tokens: int,
    default: dict[str, Any],
    temperature: float | None = None,
) -> JSONResult:
    """One structured-output chat call in stage ``st``.

    Args:
        st: the open stage (the call joins it; task context is carried by the SDK).
        messages: OpenAI chat messages.
        schema: JSON schema the output must follow (bound every string with ``maxLength`` and
            every array with ``maxItems`` so ``max_tokens`` is not hit).
        name: schema name (``response_format.json_schema.name``).
        max_tokens: output cap (tokens); >= 100 recommended for structured output.
        default: object used when the output is not valid JSON (then ``valid`` is False).

    Raises:
        jitflow.APIError: the call failed (the SDK retries admission rejections first, within the task's deadline).
    """
    r = await st.chat(messages, max_tokens=max_tokens,
                      temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
                      response_format=json_format(name, schema))
    data, valid = parse_json_object(r.content, default)
    out = r.usage.completion_tokens if r.usage is not None else 0
    return JSONResult(data, valid, out)


async def chat_text(st: jitflow.Stage, messages: list[dict[str, Any]], *, max_tokens: int,
                    temperature: float | None = None) -> str:
    """One free-text chat call in stage ``st`` (its text never drives control flow).

    Raises:
        jitflow.APIError: the call failed (the SDK retries admission rejections first, within the task's deadline).
    """
    r = await st.chat(messages, max_tokens=max_tokens,
                      temperature=DEFAULT_TEMPERATURE if temperature is None else temperature)
    return r.content or ""


def jitflow_error(exc: BaseException) -> BaseException | None:
    """The jitflow error behind ``exc`` (unwrapping anyio exception groups), or None."""
    if isinstance(exc, jitflow.JitflowError):
        return exc
    subs = getattr(exc, "exceptions", None)
    if subs:
        found = [jitflow_error(e) for e in subs]
        if all(f is not None for f in found):
            deadline = [f for f in found if isinstance(f, jitflow.DeadlineExceededError)]
            return deadline[0] if deadline else found[0]
    return None


# ---------------------------------------------------------------------- task reports
@dataclass
class StageReport:
    """One stage of a finished task, times relative to the task start (seconds).

    ``sub_deadline`` is the stage's sub-deadline ``φ(s)·D`` relative to the task start
    (JITServe §4.1), from the server's task view or, failing that, from the responses' timing
    objects; ``None`` when the server computed none (e.g. no matching history).
    """

    index: int
    name: str
    start: float
    end: float | None
    llm_calls: int = 0
    tool_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    sub_deadline: float | None = None

    @property
    def met_sub_deadline(self) -> bool | None:
        """Whether the stage ended by its sub-deadline (None if either is unknown)."""
        if self.sub_deadline is None or self.end is None:
            return None
        return self.end <= self.sub_deadline + 1e-6


@dataclass
class TaskReport:
    """Summary of one compound task run by an example app.

    Attributes:
        app: application name (``deep-research`` / ``tree-of-thoughts``).
        task_id: SDK task id (also the server's id).
        outcome: ``succeeded`` | ``deadline_missed`` | ``rejected`` (a call was not admitted by the
            server's admission control, after retries: a missed deadline, not a crash) | ``failed``.
        error: ``"ExcType: message"`` when the task did not succeed because of an exception.
        deadline: end-to-end deadline D (s).
        start_time: task start T0 (unix s).
        elapsed: wall time from T0 to the task's end (s).
        stages: per-stage reports.
        server_view: ``GET /v1/tasks/{id}`` JSON, or None if the server has no task API.
        telemetry: the client's telemetry counters after the task.
    """

    app: str
    task_id: str
    outcome: str
    error: str | None
    deadline: float
    start_time: float
    elapsed: float
    stages: list[StageReport] = field(default_factory=list)
    server_view: dict[str, Any] | None = None
    telemetry: dict[str, int] = field(default_factory=dict)

    @property
    def met_deadline(self) -> bool:
        """True if the task succeeded within its deadline."""
        return self.outcome == "succeeded"

    @property
    def tokens(self) -> int:
        """All input + output tokens of all LLM calls (tokens): the task's goodput if it met its
        deadline (JITServe §3, compound)."""
        return sum(s.input_tokens + s.output_tokens for s in self.stages)

    @property
    def matched(self) -> Any:
        """The server's matched pattern (``server_view["matched"]``) or None."""
        return (self.server_view or {}).get("matched")

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (used by ``--json`` and the demo report)."""
        d = asdict(self)
        d["tokens"] = self.tokens
        d["met_deadline"] = self.met_deadline
        for s, sd in zip(self.stages, d["stages"]):
            sd["met_sub_deadline"] = s.met_sub_deadline
        return d


def task_report(task: jitflow.Task | None, *, app: str, deadline: float,
                error: BaseException | None = None, client: jitflow.AsyncClient | None = None) -> TaskReport:
    """Build a :class:`TaskReport` from the SDK's :class:`jitflow.Task` after the task exited.

    ``task`` may be None when the task never started (e.g. the server was unreachable); the
    report then has outcome ``failed``.
    """
    err = None if error is None else f"{type(error).__name__}: {error}"[:500]
    if task is None:
        return TaskReport(app, "", "failed", err, deadline, math.nan, 0.0)
    if isinstance(jitflow_error(error) if error is not None else None, jitflow.AdmissionRejectedError):
        outcome = "rejected"  # the server's admission control turned a call away (after the SDK's retries)
    else:
        outcome = task.outcome or ("deadline_missed" if isinstance(error, jitflow.DeadlineExceededError)
                                   else "failed" if error is not None else "succeeded")
    t0 = task.start_time
    end = task.end_time if task.end_time is not None else t0
    stages = []
    for st in task.stages:
        rep = StageReport(st.index, st.name, st.start - t0, None if st.end is None else st.end - t0)
        for c in st.calls:
            if c.type == "llm":
                rep.llm_calls += 1
                rep.input_tokens += c.input_tokens
                rep.output_tokens += c.output_tokens
            else:
                rep.tool_calls += 1
        if st.sub_deadline is not None:
            rep.sub_deadline = st.sub_deadline - t0
        stages.append(rep)
    tel = client.telemetry if client is not None else task.client.telemetry
    return TaskReport(task.app, task.task_id, outcome, err or task.error, task.deadline, t0, end - t0,
                      stages, None, asdict(tel))


async def fetch_server_view(client: jitflow.AsyncClient, report: TaskReport) -> None:
    """Fill ``report.server_view`` from ``GET /v1/tasks/{id}`` and take each stage's sub-deadline
    from it (relative to the task start). Leaves the report unchanged if the server has no task
    API or does not know the task (404/405) or cannot be reached."""
    if not report.task_id:
        return
    try:
        view = await client.get_task(report.task_id)
    except jitflow.APIError:
        return
    if not isinstance(view, dict):
        return
    report.server_view = view
    t0 = view.get("start_time") or report.start_time
    for sv in view.get("stages") or []:
        if not isinstance(sv, dict):
            continue
        idx, sd = sv.get("index"), sv.get("sub_deadline")
        if isinstance(idx, int) and 0 <= idx < len(report.stages) and isinstance(sd, (int, float)):
            report.stages[idx].sub_deadline = float(sd) - float(t0)


def _fmt(x: float | None, unit: str = "s") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}{unit}"


def print_task_report(report: TaskReport, *, console: Any = None, title: str | None = None) -> None:
    """Print the per-stage timings and the outcome of one task as a rich table."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title=title or f"{report.app} task {report.task_id[:12]} (deadline {report.deadline:.1f}s)")
    for col in ("#", "stage", "start", "end", "LLM+tool", "tok in/out", "sub-dl", "met"):
        t.add_column(col, justify="left" if col == "stage" else "right")
    for s in report.stages:
        met = s.met_sub_deadline
        t.add_row(str(s.index), s.name, _fmt(s.start), _fmt(s.end), f"{s.llm_calls}+{s.tool_calls}",
                  f"{s.input_tokens}/{s.output_tokens}", _fmt(s.sub_deadline),
                  "-" if met is None else ("yes" if met else "no"))
    console.print(t)
    colour = {"succeeded": "green", "deadline_missed": "yellow"}.get(report.outcome, "red")
    line = (f"outcome: [{colour}]{report.outcome}[/{colour}]  elapsed {_fmt(report.elapsed)} of "
            f"{report.deadline:.1f}s  tokens {report.tokens}")
    if report.error:
        line += f"  error: {report.error}"
    console.print(line)
    matched = report.matched
    if report.server_view is None:
        console.print("server task view: not available (server has no /v1/tasks API or unknown task)")
    else:
        console.print(f"server task view: outcome {report.server_view.get('outcome')}, matched pattern "
                      f"{json.dumps(matched)[:120] if matched else 'none'}")
    tel = report.telemetry
    if tel:
        console.print(f"telemetry: sent {tel.get('sent', 0)}, dropped {tel.get('dropped', 0)}")


# ---------------------------------------------------------------------- CLI plumbing
def add_common_args(p: argparse.ArgumentParser, *, deadline: float) -> None:
    """``--deadline``, ``--server``, ``--model``, ``--json``, ``--quiet`` (shared by both apps)."""
    p.add_argument("--deadline", type=float, default=deadline, help=f"task deadline in seconds (default {deadline})")
    p.add_argument("--server", default=None, help="jitflow server URL (default: $JITFLOW_BASE_URL or "
                   "http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="model id (default: the server's first model)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")


def positive_float(name: str, value: float) -> float:
    """Return ``value`` if positive and finite, else raise ValueError naming ``name``."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


async def check_server(client: jitflow.AsyncClient, model: str | None) -> str:
    """Check the server is reachable and serves ``model``; return the model id to use.

    Raises:
        jitflow.APIConnectionError: server unreachable.
        ValueError: ``model`` is not served.
    """
    models = [m.id for m in (await client.models.list()).data]
    if model is None:
        if not models:
            raise ValueError("the server lists no models")
        return models[0]
    if model not in models:
        raise ValueError(f"model {model!r} not served; the server has {models}")
    return model


def exit_code(outcome: str) -> int:
    """Process exit code for a task outcome: 0 succeeded, 3 deadline_missed or rejected, 1 otherwise."""
    return {"succeeded": EXIT_OK, "deadline_missed": EXIT_DEADLINE, "rejected": EXIT_DEADLINE}.get(outcome, EXIT_FAILED)


def quiet_telemetry_warnings() -> None:
    """Silence :class:`jitflow.TelemetryWarning` (the apps print the telemetry counters instead)."""
    warnings.simplefilter("ignore", jitflow.TelemetryWarning)


def die(msg: str, code: int = EXIT_USAGE) -> None:
    """Print ``error: msg`` to stderr and exit with ``code``."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(code)


def clamp_items(values: Sequence[str], n: int) -> list[str]:
    """The first ``n`` distinct non-empty strings of ``values`` (order kept)."""
    out: list[str] = []
    for v in values:
        if isinstance(v, str) and v.strip() and v not in out:
            out.append(v)
        if len(out) >= n:
            break
    return out


class AgentResult:
    """What the example apps' results share: the task ``report`` (``TaskReport`` or ``None`` when the task
    never started), from which the outcome and the task part of the JSON form come."""

    report: TaskReport | None

    @property
    def outcome(self) -> str:
        """``succeeded`` | ``deadline_missed`` | ``failed``."""
        return self.report.outcome if self.report else "failed"

    def task_dict(self) -> dict[str, Any] | None:
        """The task report as JSON (``None`` without one)."""
        return self.report.to_dict() if self.report else None


def run_cli(args: argparse.Namespace, *, validate: Callable[[], None], run: Callable[..., Any],
            render: Callable[[Any, Any], None]) -> int:
    """Run one example app from its parsed command line and return the exit code.

    ``validate()`` checks the arguments (raises ``ValueError``: exit 2); ``run(client, model)`` is the
    coroutine function of the app, called with a connected client and the model to use; with ``--json``
    the result's ``to_dict()`` is printed, else ``render(result, console)`` prints it, followed by the
    task report. Exit codes: :func:`exit_code` of the task outcome, 2 for bad arguments or an unreachable
    server.
    """
    try:
        positive_float("--deadline", args.deadline)
        validate()
    except ValueError as e:
        die(str(e), EXIT_USAGE)
    quiet_telemetry_warnings()

    async def main() -> Any:
        async with jitflow.AsyncClient(base_url=args.server) as client:
            return await run(client, await check_server(client, args.model))

    try:
        result = anyio.run(main)
    except jitflow.APIConnectionError as e:
        die(f"cannot reach the jitflow server: {e}", EXIT_USAGE)
    except (ValueError, jitflow.APIError) as e:
        die(str(e), EXIT_USAGE)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        from rich.console import Console

        con = Console()
        render(result, con)
        assert result.report is not None
        print_task_report(result.report, console=con)
    return exit_code(result.outcome)


async def run_agent_task(body: Callable[[], Any], *, app: str, deadline: float, client: Any, model: str | None,
                         metadata: dict[str, Any], fetch_view: bool = True,
                         on_cancel: Callable[[TaskReport], None] | None = None,
                         waiting_time: float | None = None) -> tuple[Any, TaskReport]:
    """Run ``await body()`` as one compound task of ``app`` (``@jitflow.agent``) and report on it.

    Returns ``(body's value or None when the task failed, TaskReport)``. Errors of the task (deadline,
    API errors, see :func:`jitflow_error`) end up in the report; anything else propagates. With
    ``fetch_view`` the server's view of the task (sub-deadlines) is added to the report. When the
    caller cancels the task (e.g. its own time limit), ``on_cancel`` gets the report of what ran so far
    (outcome ``failed``, the cancellation as its error) before the cancellation propagates.
    ``waiting_time``: the admission bound (s) of each of the task's LLM calls (None: the server's).
    """
    holder: dict[str, jitflow.Task] = {}

    @jitflow.agent(app=app, deadline=deadline, client=client, model=model, metadata=metadata,
                   waiting_time=waiting_time)
    async def task_body() -> Any:
        task = jitflow.current_task()
        assert task is not None
        holder["task"] = task
        return await body()

    error: BaseException | None = None
    value = None
    try:
        value = await task_body()
    except Exception as exc:
        error = jitflow_error(exc)
        if error is None:
            raise
    except anyio.get_cancelled_exc_class() as exc:
        if on_cancel is not None:
            on_cancel(task_report(holder.get("task"), app=app, deadline=deadline, error=exc, client=client))
        raise
    task = holder.get("task")
    used = client or (task.client if task is not None else None)
    report = task_report(task, app=app, deadline=deadline, error=error, client=used)
    if fetch_view and used is not None and task is not None and task.registered:
        await fetch_server_view(used, report)
    return value, report
