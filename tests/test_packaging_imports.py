"""Every third-party module the code imports is declared in pyproject.toml, and the SDK's own modules
need only its core dependencies (``pip install jitflow`` brings those alone). Read from the sources with
``ast`` and mapped to distributions with ``importlib.metadata``, so a new import fails here before a
fresh install fails for a user."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"jitflow", "jitflow_server", "examples", "__future__"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(requirements: list[str]) -> set[str]:
    return {_norm(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in requirements}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _imports(files, top_level_only: bool = False) -> dict[str, set[str]]:
    """Third-party top-level module → files importing it (``top_level_only``: module-level statements)."""
    out: dict[str, set[str]] = {}
    for f in files:
        tree = ast.parse(f.read_text(encoding="utf-8"))
        nodes = tree.body if top_level_only else ast.walk(tree)
        for node in nodes:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in FIRST_PARTY and top not in sys.stdlib_module_names:
                    out.setdefault(top, set()).add(str(f.relative_to(ROOT)))
    return out


def _undeclared(imports: dict[str, set[str]], declared: set[str]) -> dict[str, list[str]]:
    dists = md.packages_distributions()
    return {m: sorted(files) for m, files in imports.items()
            if not {_norm(d) for d in dists.get(m, [])} & declared}


def test_every_imported_module_is_declared():
    project = _project()
    declared = _names(project["dependencies"])
    for reqs in project["optional-dependencies"].values():
        declared |= _names(reqs)
    files = [f for base in ("sdk", "server", "examples") for f in (ROOT / base).rglob("*.py")]
    imports = _imports(files)
    assert {"httpx", "fastapi", "numpy"} <= set(imports)  # the scan sees the code
    assert _undeclared(imports, declared) == {}


def test_the_sdk_needs_only_its_core_dependencies():
    """Every import of ``jitflow`` but its integrations (which import their framework when used) and
    ``trio`` (imported only when the caller's event loop is trio's)."""
    files = [f for f in (ROOT / "sdk" / "jitflow").rglob("*.py") if "integrations" not in f.parts]
    imports = _imports(files)
    imports.pop("trio", None)
    assert {"httpx", "sniffio"} <= set(imports)
    assert _undeclared(imports, _names(_project()["dependencies"])) == {}


def test_the_sdk_modules_import_only_core_dependencies_at_load():
    """``import jitflow`` and its integrations' modules load with the core dependencies alone."""
    imports = _imports((ROOT / "sdk" / "jitflow").rglob("*.py"), top_level_only=True)
    assert _undeclared(imports, _names(_project()["dependencies"])) == {}
