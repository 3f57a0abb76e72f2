"""`kimictl sandbox` argument handling and exit codes that need no root and change nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kimictl.cli.sandbox import app

runner = CliRunner()


@pytest.mark.parametrize(("args", "needle"), [
    (["up", "--hardware", "atlas-900"], "invalid --hardware 'atlas-900'"),
    (["up", "--hosts", "0"], "--hosts 0 is out of range"),
    (["up", "--hosts", "2", "--fault", "npu-sick:atlas-01:1"], "'npu-sick'"),
    (["up", "--hosts", "2", "--fault", "npu-unhealthy:atlas-03:1"], "'atlas-03'"),
    (["up", "--hosts", "1", "--hardware", "atlas-800-a2", "--fault", "link-down:atlas-01:8"], "'8'"),
    (["up", "--name", "Bad_Name"], "invalid --name"),
    (["up", "--name", "kimi\n"], "invalid --name"),   # `$` alone accepts a trailing newline
    (["fault", "slow-link:atlas-01:fast"], "'fast'"),
])
def test_invalid_input_exits_2_and_changes_nothing(tmp_path, args, needle):
    d = tmp_path / "sb"
    result = runner.invoke(app, [*args, "--dir", str(d)])
    assert result.exit_code == 2, result.output
    assert needle in result.stderr
    assert "Traceback" not in result.output
    assert not d.exists()


def test_dir_under_a_private_mount_is_refused():
    result = runner.invoke(app, ["up", "--dir", "/etc/kimictl-sandbox"])
    assert result.exit_code == 2 and "mounts over" in result.stderr


def test_commands_without_a_sandbox(tmp_path):
    d = str(tmp_path / "none")
    result = runner.invoke(app, ["status", "--dir", d, "--output", "json"])
    assert result.exit_code == 1
    assert json.loads(result.stdout)["state"] == "absent"
    result = runner.invoke(app, ["fault", "npu-unhealthy:atlas-01:1", "--dir", d])
    assert result.exit_code == 1 and "no sandbox is up" in result.stderr
    result = runner.invoke(app, ["down", "--dir", d])
    assert result.exit_code == 0 and "nothing to tear down" in result.stdout


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for cmd in ("up", "down", "status", "fault"):
        assert cmd in result.stdout


def test_cli_module_imports_stay_light():
    code = "import sys, kimictl.cli.sandbox; print(sorted(m for m in sys.modules if m.startswith('kimictl.sandbox')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
