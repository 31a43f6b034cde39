"""The server's ``JITFLOW_*`` environment variables, read and validated in one place (pydantic-settings).

| variable | meaning | default |
|---|---|---|
| ``JITFLOW_CACHE`` | root of jitflow's user cache (demo model, length models, capacity cache) | ``~/.cache/jitflow`` |
| ``JITFLOW_HISTORY_DB`` | the pattern-graph history (SQLite) | ``<cache>/history.sqlite`` |
| ``JITFLOW_PATTERNS`` | pattern corpora (JSONL) loaded into an empty history, ``os.pathsep``-separated | none |
| ``JITFLOW_TELEMETRY`` | per-call lengths of finished tasks are appended here (JSONL) | off |
| ``JITFLOW_LENGTH_TELEMETRY`` | per-request prompt/length records for retraining the length model (JSONL) | off |
| ``JITFLOW_LENGTH_MODEL`` | the trained length model | ``<cache>/models/length-qrf.pkl`` |
| ``JITFLOW_TIME_MODEL`` | ``DECODE_S,PREFILL_S``: pins the analyzer's call-time model (s per token) | the engine's measured speed |
| ``JITFLOW_DTYPE`` | model dtype when ``--dtype auto`` | ``auto`` |
| ``JITFLOW_OTEL_EXPORTER`` | ``console``, ``file:PATH`` or ``otlp``: export the server's spans | off |
| ``JITFLOW_PARENT_PID`` | ``jitflow serve`` stops when this process (its parent) is gone; set by the demo, benchmarks and tests | off |

``jitflow serve`` sets some of them from its options before the app starts, and tests change them per test,
so :func:`env_settings` reads the environment each time it is called. Empty values count as unset.
"""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class EnvSettings(BaseSettings):
    """The ``JITFLOW_*`` variables (module docstring). Raises ``pydantic.ValidationError`` naming the
    variable when one does not parse."""

    model_config = SettingsConfigDict(env_prefix="JITFLOW_", env_ignore_empty=True, extra="ignore")

    cache: Path | None = None
    history_db: Path | None = None
    patterns: str = ""
    telemetry: Path | None = None
    length_telemetry: Path | None = None
    length_model: Path | None = None
    time_model: str = ""
    dtype: str = "auto"
    otel_exporter: str = ""
    parent_pid: int | None = None

    def cache_dir(self) -> Path:
        """``cache`` or ``~/.cache/jitflow``."""
        return (self.cache or Path.home() / ".cache" / "jitflow").expanduser()

    def pattern_files(self) -> list[Path]:
        """``patterns`` split on ``os.pathsep``."""
        import os

        return [Path(p).expanduser() for p in self.patterns.split(os.pathsep) if p]


def env_settings() -> EnvSettings:
    """The environment's settings, read now."""
    return EnvSettings()
