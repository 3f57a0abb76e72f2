"""Code that runs on the hosts' own python3 must run on the host Python floor (kimictl.HOST_PYTHON_FLOOR, 3.9).

The host-side files are the ones pyproject.toml gives ruff's floor target (per-file-target-version): kimictl/remote/
and the sandbox's engine simulator and doubles (tests/unit/test_remote.py also imports kimictl/remote/ in a bare
interpreter). The runs need a floor interpreter on this machine (kimictl.sandbox.system.floor_python);
scripts/test.sh also runs the host-side tests under it.
"""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest
from prerequisites import require_or_skip

from kimictl import HOST_PYTHON_FLOOR
from kimictl.sandbox.system import floor_python

REPO = Path(__file__).resolve().parents[2]
FLOOR = "py" + "".join(map(str, HOST_PYTHON_FLOOR))
def host_globs() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]["per-file-target-version"]


def host_files() -> list[Path]:
    return sorted({f for g in host_globs() for f in REPO.glob(g) if f.name != "__init__.py"})


@pytest.fixture(scope="module")
def floor() -> str:
    py = floor_python()
    if py is None:
        require_or_skip(f"no Python {'.'.join(map(str, HOST_PYTHON_FLOOR))} on this machine (python3.X on PATH, "
                    "pyenv under $PYENV_ROOT or /root/.pyenv)")
    return py


def test_ruff_checks_every_host_file_against_the_floor():
    globs = host_globs()
    assert set(globs.values()) == {FLOOR}, "pyproject's host target must be kimictl.HOST_PYTHON_FLOOR"
    for g in globs:   # a moved file must take its target along
        assert list(REPO.glob(g)), f"pyproject per-file-target-version: {g} matches no file"
    covered = set(host_files())
    for f in (REPO / "kimictl").rglob("*.py"):   # a new script for the hosts' python3 must be listed
        if f.read_text().startswith("#!/usr/bin/python3") and f.name != "subreaper.py":   # subreaper: control
            assert f in covered, f"{f.relative_to(REPO)} runs on hosts: add it to per-file-target-version"


def test_host_files_load_on_the_floor_python(floor):
    for f in host_files():
        r = subprocess.run([floor, "-I", "-S", "-c", "import runpy, sys; runpy.run_path(sys.argv[1], "
                                                     "run_name='kimictl_host_check')", str(f)],
                           capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 0, f"{f.relative_to(REPO)} on {floor}:\n{r.stderr[-2000:]}"



def test_floor_python_takes_the_newest_interpreter_that_says_it_is_the_floor(tmp_path, monkeypatch):
    want = ".".join(map(str, HOST_PYTHON_FLOOR))
    for version, says in (("2", want), ("10", want), ("11", "3.8")):   # 3.X.11 is not what its name says
        exe = tmp_path / "versions" / f"{want}.{version}" / "bin" / f"python{want}"
        exe.parent.mkdir(parents=True)
        exe.write_text(f"#!/bin/sh\necho {says}\n")
        exe.chmod(0o755)
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert floor_python.__wrapped__() == str(tmp_path / "versions" / f"{want}.10" / "bin" / f"python{want}")
