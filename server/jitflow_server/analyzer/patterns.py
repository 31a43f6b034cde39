"""Pattern-graph corpora from traces: the deep-research trace as pattern graphs (JITServe §4.1)."""

from __future__ import annotations

import json
from pathlib import Path

from jitflow_server.store.graph import DEEPRESEARCH_MODEL, PatternFormatError, PatternGraph

__all__ = ["deepresearch_stage_names", "load_deepresearch"]


def deepresearch_stage_names(n_stages: int) -> list[str]:
    """Stage names of the deep-research trace, inferred as the data README says.

    ``0 generate_query -> 1 web_research -> 2 reflection -> [web_research -> reflection]* ->
    last = final_answer``; e.g. 4 stages: generate_query, web_research, reflection,
    final_answer; 6 stages: ..., web_research, reflection, final_answer. (The trace does not
    label stages; this reading is inferred from its sibling test file's ``state`` field.)

    Raises:
        ValueError: ``n_stages < 1``.
    """
    if n_stages < 1:
        raise ValueError("n_stages must be >= 1")
    if n_stages == 1:
        return ["final_answer"]
    names = ["generate_query"]
    for i in range(1, n_stages - 1):
        names.append("web_research" if i % 2 == 1 else "reflection")
    names.append("final_answer")
    return names


def load_deepresearch(
    path: str | Path, app: str = "deep-research", *, model: str = DEEPRESEARCH_MODEL, stage_names: bool = True
) -> list[PatternGraph]:
    """Load the JITServe deep-research trace (``deepresearch_training.json``) as pattern graphs.

    Each record ``{"request_id", "stages": [{"stage_number", "requests": [{"input_tokens",
    "output_tokens", ...}]}]}`` becomes a token-only graph (no times: stage times come from
    :class:`~jitflow_server.analyzer.subdeadline.CallTimeModel`). Every call is an LLM call
    to ``model``; calls of a stage depend on all calls of the previous stage.

    Args:
        stage_names: name stages with :func:`deepresearch_stage_names` (else unnamed).

    Raises:
        FileNotFoundError, PatternFormatError: missing file / unexpected schema.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PatternFormatError(f"{path}: not a JSON file: {e}") from e
    if not isinstance(data, list):
        raise PatternFormatError(f"{path}: expected a JSON list of deep-research records")
    out = []
    for k, rec in enumerate(data):
        try:
            stages = sorted(rec["stages"], key=lambda s: s["stage_number"])
            calls = [[(int(r["input_tokens"]), int(r["output_tokens"])) for r in st["requests"]] for st in stages]
            names = deepresearch_stage_names(len(calls)) if stage_names else None
            out.append(
                PatternGraph.from_stage_lengths(
                    app, calls, model=model, stage_names=names, outcome="ok",
                    task_id=str(rec.get("request_id", k)),
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PatternFormatError(f"{path}: record {k}: {e!r}") from e
    return out
