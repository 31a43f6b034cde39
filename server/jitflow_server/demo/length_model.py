"""The demo's length model: trained once from AlpacaEval responses (``--data``) or the corpus shipped in
``patterns/`` (the demo model's own request telemetry), cached, and handed to the server.

The model file is named by a hash over the training files' bytes and the predictor's feature and format
versions, so a later run with the same data reuses it and a change of either retrains. Training runs
``jitflow analyzer train-length`` as a subprocess (the same code path a user runs), so it can overlap
with the server's start-up.
"""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

from jitflow_server.bench.server_process import jitflow_command
from jitflow_server.demo.plan import REPO_ROOT, DemoError
from jitflow_server.settings import env_settings


def default_dir() -> Path:
    """``<JITFLOW_CACHE>/models`` (default ``~/.cache/jitflow/models``), read now."""
    return env_settings().cache_dir() / "models"


#: Telemetry JSONL of the demo model's own requests (``jitflow serve --length-telemetry``), shipped so that
#: the demo has a trained length model on a machine without the AlpacaEval data.
SHIPPED_CORPUS = REPO_ROOT / "patterns" / "length" / "demo-telemetry.jsonl"


@dataclass
class LengthModelJob:
    """The length model the demo uses: where it is, what it was trained on, and (while training) the
    ``train-length`` subprocess.

    Attributes:
        path: model file (exists once :meth:`wait` returned without error).
        sources: training files.
        source_kind: ``alpaca_eval`` | ``shipped telemetry``.
        trained: True when this run trained the model, False when the cache was reused.
    """

    path: Path
    sources: list[Path]
    source_kind: str
    trained: bool
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def done(self) -> bool:
        """True when no training subprocess is running (finished, failed, or the model was cached)."""
        proc = self.proc  # read once: :meth:`wait` may clear it from another thread
        return proc is None or proc.poll() is not None

    def wait(self, timeout: float = 600.0) -> None:
        """Wait for the training subprocess (no-op when the model was cached).

        Raises:
            DemoError: training failed or did not finish within ``timeout`` s (with its output's tail).
        """
        if self.proc is None:
            return
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise DemoError(f"training the length model took more than {timeout:.0f} s") from None
        finally:
            self.proc = None
        if rc != 0 or not self.path.is_file():
            tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path else ""
            raise DemoError(f"training the length model failed (exit {rc}):\n{tail}")

    def cancel(self) -> None:
        """Stop a training subprocess still running (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def training_sources(data_dir: Path | None) -> tuple[list[Path], str]:
    """``(files, kind)``: every ``DIR/alpaca_eval/*.json`` when present, else the shipped telemetry corpus.

    Raises:
        DemoError: neither is available.
    """
    if data_dir is not None:
        files = sorted((data_dir / "alpaca_eval").glob("*.json"))
        if files:
            return files, "alpaca_eval"
    if SHIPPED_CORPUS.is_file():
        return [SHIPPED_CORPUS], "shipped telemetry"
    raise DemoError(f"no training data for the length model: neither {data_dir}/alpaca_eval/*.json nor "
                    f"{SHIPPED_CORPUS}")


def model_path(sources: list[Path], cache_dir: Path | None = None) -> Path:
    """Cache file (in ``cache_dir``, default :func:`default_dir`) of the model trained on ``sources``: a
    SHA-256 over their bytes and the predictor's feature and format versions."""
    from jitflow_server.analyzer.length import FEATURE_VERSION, FORMAT_VERSION

    cache_dir = cache_dir if cache_dir is not None else default_dir()
    h = hashlib.sha256(f"f{FEATURE_VERSION}/m{FORMAT_VERSION}".encode())
    for f in sources:
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return cache_dir.expanduser() / f"demo-length-qrf-{h.hexdigest()[:16]}.pkl"


def start_length_model(data_dir: Path | None, log_path: Path, cache_dir: Path | None = None) -> LengthModelJob:
    """Reuse the cached model for this data, or start training it in a subprocess (call
    :meth:`LengthModelJob.wait` before starting the server that loads it).

    Raises:
        DemoError: no training data (see :func:`training_sources`).
    """
    from jitflow_server.analyzer.length import LengthModelError, LengthPredictor

    sources, kind = training_sources(data_dir)
    path = model_path(sources, cache_dir)
    if path.is_file():
        try:
            LengthPredictor.load(path)
            return LengthModelJob(path, sources, kind, trained=False)
        except (LengthModelError, OSError, ValueError):
            path.unlink(missing_ok=True)  # unreadable (older format): retrain over it
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = jitflow_command("analyzer", "train-length", "--out", str(path))
    for f in sources:
        cmd += ["--data", str(f)]
    log = open(log_path, "w")  # noqa: SIM115 - the subprocess owns it until it exits
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    return LengthModelJob(path, sources, kind, trained=True, proc=proc, log_path=log_path)
