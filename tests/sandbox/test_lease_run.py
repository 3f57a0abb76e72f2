"""The cluster lease over real SSH on the shared 2-host A3 sandbox: a command that changes hosts is refused (exit 2,
naming the holder) while another control node holds the lease, `--wait` queues behind it, `status` shows it, and a
holder killed with SIGKILL (its whole process group, as a cancelled CI job is) lets go at once: its script on the
lock host is gone and the next command takes the lease.

The commands used are `stop` (on this sandbox nothing else serves meanwhile: it stops nothing or what a test left
running, which later tests do not rely on) and `status`."""

from __future__ import annotations

import getpass
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import kimictl

from kimictl.inventory import load_inventory

pytestmark = pytest.mark.sandbox

# Another control node: holds the lease through kimictl's own code (real SSH, paramiko) until it is killed.
HOLD = """
import sys, time
from kimictl import lease
from kimictl.inventory import load_inventory
with lease.held(load_inventory(sys.argv[1]), sys.argv[2]):
    print("held", flush=True)
    time.sleep(1800)
"""
COMMAND = "rollout (sandbox lease test)"


class Proc:
    """A subprocess in its own process group whose output lines are collected as they come."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None):
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True, env={**os.environ, **(env or {})})
        self.out: queue.Queue = queue.Queue()
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        for stream, lines in ((self.p.stdout, self.stdout), (self.p.stderr, self.stderr)):
            threading.Thread(target=self._read, args=(stream, lines), daemon=True).start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)
            self.out.put(line)

    def wait_for(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(needle in line for line in self.stdout + self.stderr):
                return
            if self.p.poll() is not None:
                time.sleep(0.5)   # let the readers drain
                if any(needle in line for line in self.stdout + self.stderr):
                    return
                break
            time.sleep(0.2)
        raise AssertionError(f"no {needle!r} within {timeout}s (rc {self.p.poll()}):\n{''.join(self.stdout)}\n"
                             f"{''.join(self.stderr)[-3000:]}")

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(30)


def _lease(a3) -> dict:
    proc = kimictl("status", "-i", str(a3.inventory), "--output", "json", "--no-pair-probe", timeout=300)
    doc = json.loads(proc.stdout)
    assert "lease" in doc, proc.stderr[-2000:]
    return doc["lease"]


def _record(a3, state_dir: str) -> str:
    return a3.ssh("atlas-01", f"cat {state_dir}/lease.lock").stdout


def test_the_lease_refuses_queues_shows_and_dies_with_its_holder(a3) -> None:
    inv = load_inventory(a3.inventory)
    lock = min(h.name for h in inv.hosts)
    assert lock == "atlas-01"
    state_dir = inv.host(lock).kimi_state_dir
    holder = Proc([sys.executable, "-c", HOLD, str(a3.inventory), COMMAND])
    waiter = None
    try:
        holder.wait_for("held", timeout=120)
        record = json.loads(_record(a3, state_dir))
        assert record["command"] == COMMAND and record["pid"] == holder.p.pid
        lock_pid = record["lock_pid"]

        # a second control node's change is refused at once, naming the holder; nothing ran
        refused = kimictl("stop", "-i", str(a3.inventory), "--yes", timeout=300)
        assert refused.returncode == 2, refused.stderr[-3000:]
        who = f"`{COMMAND}` of {getpass.getuser()}@{socket.gethostname()} (pid {holder.p.pid}, since "
        assert f"error: cluster {inv.cluster.name} is leased to {who}" in refused.stderr, refused.stderr
        assert "nothing was changed" in refused.stderr and "the lease lives on atlas-01" in refused.stderr

        # status shows it (and does not disturb it)
        shown = _lease(a3)
        assert shown["host"] == "atlas-01" and shown["state"] == "held", shown
        assert shown["holder"]["pid"] == holder.p.pid and shown["holder"]["command"] == COMMAND
        text = kimictl("status", "-i", str(a3.inventory), "--no-pair-probe", timeout=300).stdout
        assert f"lease: held by {who}" in text, text

        # --wait queues behind the holder and says whom it waits for
        waiter = Proc([sys.executable, "-m", "kimictl", "stop", "-i", str(a3.inventory), "--yes", "--wait", "300"])
        waiter.wait_for("waiting up to 300s for the cluster lease: " + who, timeout=120)
        assert waiter.p.poll() is None

        # the holder's control node is killed: its script on the lock host goes with its SSH session, and the
        # waiting command takes the lease and runs
        holder.kill()
        rc = waiter.p.wait(timeout=600)
        assert rc == 0, "".join(waiter.stderr)[-3000:]
        gone = a3.ssh("atlas-01", f"test -d /proc/{lock_pid} && echo alive || echo gone").stdout.strip()
        assert gone == "gone"
        assert "leased" not in "".join(waiter.stderr)
    finally:
        holder.kill()
        if waiter is not None:
            waiter.kill()

    # everything let go: the lease is free and its record empty
    assert _lease(a3) == {"host": "atlas-01", "state": "free"}
    assert _record(a3, state_dir) == ""


def test_a_holder_killed_with_sigkill_is_free_at_once_over_ssh(a3) -> None:
    """Without anyone waiting: within seconds of the kill the lock host has dropped the lease (no 60 s heartbeat
    expiry: sshd closes the script's stdin when the connection goes)."""
    inv = load_inventory(a3.inventory)
    holder = Proc([sys.executable, "-c", HOLD, str(a3.inventory), COMMAND])
    try:
        holder.wait_for("held", timeout=120)
        lock_pid = json.loads(_record(a3, inv.host("atlas-01").kimi_state_dir))["lock_pid"]
    finally:
        holder.kill()
    deadline = time.monotonic() + 30
    while True:
        alive = a3.ssh("atlas-01", f"test -d /proc/{lock_pid} && echo alive || echo gone").stdout.strip()
        if alive == "gone" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert alive == "gone", "the lease script outlived its SSH session"
    assert _lease(a3) == {"host": "atlas-01", "state": "free"}
    # and the next command takes it at once
    took = Proc([sys.executable, "-c", HOLD, str(a3.inventory), "second holder"])
    try:
        took.wait_for("held", timeout=120)
    finally:
        took.kill()
