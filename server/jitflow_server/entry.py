"""The ``jitflow`` console script's entry point.

``pip install jitflow`` installs the SDK alone (httpx, anyio, sniffio, pydantic, the OpenTelemetry API,
tenacity) and, with it, the ``jitflow`` script. The commands need more (``jitflow[server]``: typer,
rich, numpy, FastAPI, the OpenTelemetry SDK, ...): this entry point checks for them before importing
the command line and names the extra to install instead of failing with an ``ImportError`` traceback.
"""

from __future__ import annotations

import importlib.util
import sys

#: Modules the command line imports at start-up, with the extra that installs each.
NEEDED = {"typer": "cli", "rich": "cli", "numpy": "server", "fastapi": "server", "uvicorn": "server",
          "opentelemetry.sdk": "otel"}


def missing() -> list[str]:
    """The modules of :data:`NEEDED` that cannot be imported here."""
    out = []
    for name in NEEDED:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a missing parent package, or a module blocked in sys.modules
            found = False
        if not found:
            out.append(name)
    return out


def main() -> None:
    """Run the ``jitflow`` command line, or exit 2 with the ``pip install`` line that makes it work."""
    gone = missing()
    if gone:
        sys.stderr.write(f"jitflow: the command line needs {', '.join(gone)}, which `pip install jitflow` (the "
                         "SDK alone) does not install; run: pip install 'jitflow[server]'\n")
        raise SystemExit(2)
    from jitflow_server.cli import main as cli_main

    cli_main()
