"""Every file under kimictl/remote/ runs on a host: it must compile and import under the oldest Python the hosts
may have (3.9) with nothing but the standard library, and never import kimictl."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prerequisites import require_or_skip

from kimictl import remote
from kimictl.sandbox.system import floor_python

REMOTE = Path(__file__).resolve().parents[2] / "kimictl" / "remote"
HOST_FILES = sorted(Path(p).name for p in glob.glob(str(REMOTE / "*.py")))

# Import every file by path in one isolated interpreter (-I: no user site, no cwd on sys.path; -S: no
# site-packages), each under its own name; then prove kimictl was neither imported nor importable.
_PROBE = r"""
import importlib.util, json, sys, traceback
out = {}
for path in sys.argv[1:]:
    try:
        spec = importlib.util.spec_from_file_location("kimictl_remote_probe_%d" % len(out), path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        out[path] = "ok"
    except BaseException:
        out[path] = traceback.format_exc()[-2000:]
    if [m for m in sys.modules if m == "kimictl" or m.startswith("kimictl.")]:
        out[path] = "imported kimictl"
try:
    import kimictl  # noqa: F401
    out["kimictl"] = "importable in the bare interpreter: the check proves nothing"
except ImportError:
    pass
print(json.dumps({"version": list(sys.version_info[:2]), "files": out}))
"""


def _python39() -> str | None:
    return floor_python()


def test_the_host_files_are_found() -> None:
    assert {"supervisor.py", "proxy_front.py", "weights_agent.py", "read_current.py", "log_tail.py",
            "diag_bundle.py"} <= set(HOST_FILES)


@pytest.fixture(scope="module")
def bare39() -> dict:
    py = _python39()
    if py is None:
        require_or_skip("no Python 3.9 on this machine (see floor_python): cannot check the host floor here")
    out = subprocess.run([py, "-I", "-S", "-c", _PROBE, *(str(REMOTE / n) for n in HOST_FILES)], capture_output=True,
                         text=True, timeout=120, check=False, cwd="/",
                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert doc["version"] == [3, 9] and "kimictl" not in doc["files"], doc
    return doc["files"]


@pytest.mark.parametrize("name", HOST_FILES)
def test_host_file_imports_in_a_bare_python39(name: str, bare39: dict) -> None:
    assert bare39[str(REMOTE / name)] == "ok"


def test_scripts_are_shipped_as_text_from_their_files() -> None:
    assert remote.script("read_current.py") == (REMOTE / "read_current.py").read_text()
    with pytest.raises(FileNotFoundError, match=r"no-such\.py"):
        remote.source("no-such.py")


def _state_dir(tmp_path: Path) -> Path:
    sd = tmp_path / "kimi"
    rel = sd / "releases" / "r1"
    (rel / "engines").mkdir(parents=True)
    (rel / "engines" / "decode-0-dp0.sh").write_text("exec vllm serve\n")
    (rel / "manifest.json").write_text('{"release": "r1", "engines": [{"id": "decode-0-dp0", "role": "decode"}]}')
    (sd / "current").symlink_to(rel)
    (sd / "logs").mkdir()
    (sd / "logs" / "decode-0-dp0.log").write_text("".join(f"line {i}\n" for i in range(100)))
    (sd / "run").mkdir()
    (sd / "run" / "decode-0-dp0.json").write_text("{}")
    return sd


def _run_piped(name: str, arg: str) -> dict:
    """As the control node runs it: `python3 - ARG` with the file's text on stdin."""
    out = subprocess.run([_python39() or sys.executable, "-I", "-S", "-", arg], input=remote.script(name),
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_read_current_and_log_tail_read_a_state_dir(tmp_path: Path) -> None:
    sd = _state_dir(tmp_path)
    cur = _run_piped("read_current.py", str(sd))
    assert cur["release"] == "r1" and cur["files"] == {"engines/decode-0-dp0.sh": "exec vllm serve\n"}
    assert _run_piped("read_current.py", str(tmp_path / "none")) is None
    got = _run_piped("log_tail.py", json.dumps({"sd": str(sd), "lines": 3}))
    assert got["logs"] == {"decode-0-dp0": ["line 97", "line 98", "line 99"]} and got["states"] == ["decode-0-dp0"]


def test_diag_bundle_caps_files_and_records_what_it_cannot_run(tmp_path: Path) -> None:
    sd = _state_dir(tmp_path)
    got = _run_piped("diag_bundle.py", json.dumps({"sd": str(sd), "cap": 40, "npus": 1,
                                                    "model_dir": str(tmp_path / "m")}))
    log = got["files"]["logs/decode-0-dp0.log"]
    assert log.startswith("[kimictl: first ") and log.endswith("line 99\n")
    assert got["files"]["release/engines/decode-0-dp0.sh"] == "exec vllm serve\n"
    assert got["meta"]["current"] == "r1" and "npu-smi-info.txt" in got["files"]
