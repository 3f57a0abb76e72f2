"""Any control node, one change at a time (issue 34), on the 4-host A3 sandbox (a3-pd = 2P2D behind kimictl's
proxy front with an API key, the deployment of test_rollout_slices).

Control node A is this test's own state dir (it deployed the cluster); control node B is a fresh, empty
KIMICTL_STATE_DIR with the same inventory and SSH key, as a CI runner is. B reads the cluster's keys and release
record back from the hosts: its status is healthy (no 403 from the routers' admin API), its plan shows no change,
it rolls a change out under client load with no client error, and A (whose own record never saw B's rollout)
rolls it back from the cluster's record. One change at a time: while A rolls out, B's deploy is refused naming
the lease holder and B's unattended `status --watch --heal` takes no action; once A's rollout is killed with
SIGKILL (its process group, as a cancelled CI job), B takes the lease and converges the cluster.
"""

from __future__ import annotations

import json
import sys
import time

import pytest
from conftest import kimictl

from tests.sandbox.test_lease_run import Proc
from tests.sandbox.test_rollout_slices import API_KEY, Load, _state_dir, cluster

pytestmark = pytest.mark.sandbox
__all__ = ["cluster"]  # the deployment this module shares with test_rollout_slices (module-scoped fixture)


def _status(inv: str, env: dict[str, str] | None = None) -> tuple[int, dict, str]:
    st = kimictl("status", "-i", inv, "--output", "json", timeout=300, env=env)
    return st.returncode, json.loads(st.stdout), st.stderr


def _proxy(sb) -> str:
    return f"http://{sb.host('atlas-01')['ip']}:8000/v1/completions"


def _wait_lease(inv: str, command: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    lease: dict = {}
    while time.monotonic() < deadline:
        st = kimictl("status", "-i", inv, "--output", "json", "--no-pair-probe", timeout=300)
        lease = json.loads(st.stdout).get("lease") or {}
        if lease.get("state") == "held" and lease["holder"]["command"] == command:
            return lease
        time.sleep(1)
    raise AssertionError(f"no `{command}` holds the lease within {timeout}s: {lease}")


def test_a_second_control_node_reads_keys_and_record_back_and_a_rolls_its_change_back(cluster, tmp_path) -> None:
    sb = cluster
    inv = str(sb.inventory)
    code, st_a, _ = _status(inv)
    assert code == 0 and st_a["state"] == "healthy", st_a
    original = st_a["release"]
    b_dir = tmp_path / "control-node-b"
    b = {"KIMICTL_STATE_DIR": str(b_dir)}

    code, st_b, err = _status(inv, b)
    assert code == 0, err[-3000:]
    assert st_b["state"] == "healthy" and st_b["release"] == original, st_b
    assert "403" not in err + json.dumps(st_b)
    assert "read the cluster's release record from atlas-01, atlas-02, atlas-03" in err, err[-2000:]
    # B holds the cluster's admin key, not one of its own
    a_keys, b_keys = _state_dir(sb) / "secrets", b_dir / sb.cluster / "secrets"
    assert (b_keys / "proxy-admin-key").read_text() == (a_keys / "proxy-admin-key").read_text()
    plan = kimictl("plan", "-i", inv, "--topology", "a3-pd", "--detailed-exitcode", env=b, timeout=300)
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
    assert f"deployed: release {original}; no changes" in plan.stdout

    load = Load(_proxy(sb), threads=2, api_key=API_KEY).start()
    keepalive = Load(_proxy(sb), threads=1, api_key=API_KEY, keepalive=True).start()
    time.sleep(2)
    ro = kimictl("rollout", "-i", inv, "--set", "decode.serve.max-num-seqs=16", "--yes", "--output", "json",
                 env=b, timeout=1800)
    time.sleep(2)
    for lo in (load, keepalive):
        lo.stop()
    assert ro.returncode == 0, ro.stderr[-4000:]
    rolled = json.loads(ro.stdout)
    print(f"\nB's rollout: {rolled['release']}; clients {load.ok} ok, errors {load.kinds()}; keep-alive "
          f"{keepalive.ok} ok, errors {keepalive.kinds()}")
    assert rolled["result"] == "rolled-out" and rolled["previous_release"] == original
    for lo in (load, keepalive):
        assert lo.errors == [], lo.errors[:5]
        assert lo.ok >= 10

    # A's own record never saw B's rollout: its rollback reads the cluster's record and returns to `original`
    back = kimictl("rollback", "-i", inv, "--yes", "--output", "json", timeout=1800)
    assert back.returncode == 0, back.stderr[-4000:]
    assert json.loads(back.stdout)["release"] == original
    for env in (None, b):
        code, st, err = _status(inv, env)
        assert code == 0 and st["state"] == "healthy" and st["release"] == original, (env, st, err[-2000:])


def test_one_change_at_a_time_across_control_nodes(cluster, tmp_path) -> None:
    sb = cluster
    inv = str(sb.inventory)
    b_dir = tmp_path / "control-node-b"
    b = {"KIMICTL_STATE_DIR": str(b_dir)}
    code, st, _ = _status(inv)
    assert code == 0 and st["state"] == "healthy", st

    # B watches and heals, unattended, while A rolls a change out under client load
    load = Load(_proxy(sb), threads=2, api_key=API_KEY).start()
    watch = Proc([sys.executable, "-m", "kimictl", "status", "-i", inv, "--watch", "2", "--heal", "--no-pair-probe"],
                 env=b)
    rollout = Proc([sys.executable, "-m", "kimictl", "rollout", "-i", inv, "--set", "decode.serve.max-num-seqs=20",
                    "--yes", "--output", "json"])
    try:
        lease = _wait_lease(inv, "rollout")
        assert lease["holder"]["pid"] == rollout.p.pid
        refused = kimictl("deploy", "-i", inv, "--topology", "a3-pd", "--yes", env=b, timeout=120)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "is leased to `rollout` of " in refused.stderr and f"(pid {rollout.p.pid}," in refused.stderr
        assert rollout.p.wait(timeout=1800) == 0, "".join(rollout.stderr)[-4000:]
        time.sleep(6)   # B's watch sees the rolled-out cluster at least once more
        assert watch.p.poll() is None, "".join(watch.stderr)[-3000:]
    finally:
        load.stop()
        watch.kill()
        rollout.kill()
    print(f"\nA's rollout under B's heal watch: clients {load.ok} ok, errors {load.kinds()}")
    assert load.errors == [], load.errors[:5]
    events = b_dir / sb.cluster / "heal-events.jsonl"
    acted = [json.loads(x) for x in events.read_text().splitlines()] if events.exists() else []
    assert [e for e in acted if e.get("event") == "action"] == [], acted
    code, st, err = _status(inv, b)
    assert code == 0 and st["state"] == "healthy", (st, err[-2000:])

    # A's next rollout is killed mid-way with its whole process group; B takes the lease and converges
    killed = Proc([sys.executable, "-m", "kimictl", "rollout", "-i", inv, "--set", "decode.serve.max-num-seqs=24",
                   "--yes"])
    try:
        killed.wait_for("drained ", timeout=600)
    finally:
        killed.kill()
    dep = kimictl("deploy", "-i", inv, "--topology", "a3-pd", "--yes", "--wait", "30", "--output", "json", env=b,
                  timeout=1800)
    assert dep.returncode == 0, dep.stderr[-4000:]
    code, st, err = _status(inv, b)
    assert code == 0 and st["state"] == "healthy", (st, err[-2000:])
    assert st["release"] == json.loads(dep.stdout)["release"]
    assert [(m["router"], m["missing"]) for m in st["proxy"]["membership"]] == [(0, []), (1, [])]
