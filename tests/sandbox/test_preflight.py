"""Preflight against the sandbox: a healthy cluster passes; each fault fails exactly its checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import kimictl

pytestmark = pytest.mark.sandbox
GUIDE = (Path(__file__).resolve().parents[2] / "docs" / "operators.md").read_text()


def _preflight(sb, topology: str):
    # RES-001 judges free disk against the exact checkpoint size: preflight reads the sandbox hub's listing
    proc = kimictl("preflight", "-i", str(sb.inventory), "--topology", topology, "--output", "json")
    assert "Traceback" not in proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def _failed(doc) -> list[tuple[str, str, str]]:
    return [(r["host"], r["id"], r["message"]) for r in doc["results"]
            if r["status"] == "fail" and r["severity"] == "error"]


@pytest.mark.parametrize(("fixture", "topology"), [("sandbox_a3", "a3-pd"), ("sandbox_a2", "a2-colocated")])
def test_healthy_sandbox_passes(request, fixture: str, topology: str) -> None:
    sb = request.getfixturevalue(fixture)
    rc, doc = _preflight(sb, topology)
    assert rc == 0, _failed(doc)
    assert doc["summary"]["ok"] is True and doc["summary"]["errors"] == 0
    for host in sb.hosts:
        passed = {r["id"] for r in doc["results"] if r["host"] == host and r["status"] == "pass"}
        assert len(passed) >= 12, (host, sorted(passed))


# fault -> the (host, check id) pairs that must fail, and text the first message must contain
FAULTS = [
    ("npu-unhealthy:atlas-01:3", {("atlas-01", "HW-003")}, "NPU 3"),
    ("driver-mismatch:atlas-01", {("atlas-01", "VER-001")}, "23.0.rc3"),
    ("small-disk:atlas-02:16M", {("atlas-02", "RES-001")}, "/var/lib/kimi/models"),
    ("port-taken:atlas-01:7101", {("atlas-01", "RES-003")}, "port 7101"),
    ("host-down:atlas-02", {("atlas-02", "SSH-001")}, "10.200."),
    ("cut-route:atlas-01:atlas-02", {("atlas-01", "NET-005"), ("atlas-02", "NET-005")}, "unreachable"),
    # a dead RoCE port: link and health on that NPU, and the pings over it from both sides
    ("link-down:atlas-02:5", {("atlas-02", "NET-001"), ("atlas-02", "NET-002"), ("atlas-02", "NET-005"),
                              ("atlas-01", "NET-005")}, "NPU 5"),
]


@pytest.mark.parametrize(("spec", "expected", "text"), FAULTS, ids=[f[0].split(":")[0] for f in FAULTS])
def test_fault_fails_its_check(a3, spec: str, expected: set, text: str) -> None:
    a3.fault(spec)
    rc, doc = _preflight(a3, "a3-pd")
    failed = _failed(doc)
    assert rc == 1
    assert {(h, i) for h, i, _ in failed} == expected
    assert any(text in m for *_, m in failed), failed
    # each failed check's fix points at its row of the operator's guide, which names the check
    for r in (r for r in doc["results"] if r["status"] == "fail"):
        anchor = f"t-{r['id'].lower()}"
        assert r["fix"].endswith(f"see docs/operators.md#{anchor}"), r
        assert f'<a id="{anchor}"></a>{r["id"]}' in GUIDE, r["id"]
