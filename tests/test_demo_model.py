"""The demo model builder: processes that start together share one build."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from jitflow_server.engine.demo_model import VARIANTS, build_demo_model

_BUILD = "import sys; from jitflow_server.engine.demo_model import build_demo_model; " \
         "print(build_demo_model('tiny', sys.argv[1]))"


def test_processes_started_together_share_one_complete_build(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD, str(out)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in results]
    assert {Path(o.strip().splitlines()[-1]) for o, _ in results} == {out}
    meta = json.loads((out / "jitflow-demo.json").read_text())
    assert meta["variant"] == "tiny" and meta["spec"]["vocab_size"] == VARIANTS["tiny"].vocab_size
    assert list(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file()
    assert not out.with_name("tiny.partial").exists()


def test_a_complete_build_is_reused_and_force_rebuilds_it(tmp_path: Path) -> None:
    out = build_demo_model("tiny", tmp_path / "m")
    stamp = out / "jitflow-demo.json"
    first = stamp.stat().st_mtime_ns
    assert build_demo_model("tiny", out) == out and stamp.stat().st_mtime_ns == first
    build_demo_model("tiny", out, force=True)
    assert stamp.stat().st_mtime_ns != first
