"""Collect this host's diagnostics for `kimictl logs --bundle` and print them as one JSON document.

Run on a host (one SSH round trip per host): `python3 - ARGS_JSON` with this file on stdin; ARGS_JSON is
{"sd": state dir, "cap": bytes kept per file (0 = whole files), "npus": N, "model_dir": DIR}. Read-only:
npu-smi and hccn_tool queries, the logs, the current release's files, the supervisor's state files and what
`weights pull/verify` recorded. Output: {files: {relpath: text}, meta: {hostname, uname, state_dir, current,
errors}}; the control node redacts it before anything is written, and trusts none of the names: it rebuilds each
member name from kimictl's own folders (kimictl/logs.py HOST_FILES, HOST_FOLDERS; anything else lands in other/)
and a safe form of the file name.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import socket
import subprocess
import sys


class Collector:
    def __init__(self, cap: int):
        self.cap = cap
        self.files: dict = {}
        self.errors: list = []
        self.env = dict(os.environ)
        self.env["PATH"] = ("/usr/local/bin:/usr/local/sbin:/usr/local/Ascend/driver/tools:/usr/sbin:/usr/bin:/sbin:"
                            "/bin:" + self.env.get("PATH", ""))
        self.env["LC_ALL"] = "C"

    def read(self, path: str, name: str) -> None:
        """A file, or its last `cap` bytes (from a line start) with a note of what was left out."""
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                if self.cap and size > self.cap:
                    f.seek(size - self.cap)
                    data = f.read()
                    data = data[data.find(b"\n") + 1:]
                    data = f"[kimictl: first {size - len(data)} of {size} bytes left out]\n".encode() + data
                else:
                    data = f.read()
            self.files[name] = data.decode("utf-8", "replace")
        except OSError as e:
            self.errors.append(f"{name}: {e}")

    def run(self, argv: list, name: str) -> None:
        """A command's output (stdout and stderr), with its exit code when not 0."""
        try:
            p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30, env=self.env,
                               check=False)
            out = p.stdout.decode("utf-8", "replace")
            self.files[name] = out if p.returncode == 0 else out + f"\n[kimictl: exit code {p.returncode}]\n"
        except OSError as e:
            self.files[name] = f"[kimictl: cannot run {argv[0]}: {e}]\n"
        except subprocess.TimeoutExpired:
            self.files[name] = f"[kimictl: {' '.join(argv)} timed out after 30s]\n"


def collect(sd: str, cap: int, npus: int, model_dir: str) -> dict:
    c = Collector(cap)
    c.run(["npu-smi", "info"], "npu-smi-info.txt")
    for i in range(npus):
        c.run(["hccn_tool", "-i", str(i), "-link", "-g"], f"hccn/npu{i:02d}-link.txt")
        c.run(["hccn_tool", "-i", str(i), "-net_health", "-g"], f"hccn/npu{i:02d}-net_health.txt")
    for p in sorted(glob.glob(os.path.join(sd, "logs", "*.log")) + glob.glob(os.path.join(sd, "logs", "*.log.1"))):
        c.read(p, "logs/" + os.path.basename(p))
    cur = None
    if os.path.islink(os.path.join(sd, "current")):
        cur = os.path.realpath(os.path.join(sd, "current"))
        for root, _dirs, names in os.walk(cur):
            for n in sorted(names):
                full = os.path.join(root, n)
                c.read(full, "release/" + os.path.relpath(full, cur))
    for p in sorted(glob.glob(os.path.join(sd, "run", "*.json"))):
        c.read(p, "run/" + os.path.basename(p))
    for n in (".kimi-complete", ".kimi-stamps.json"):   # what `weights pull/verify` recorded
        if os.path.exists(os.path.join(model_dir, n)):
            c.read(os.path.join(model_dir, n), "weights/" + n.lstrip("."))
    sup = os.path.join(sd, "bin", "supervisor.py")
    if os.path.exists(sup):
        c.run([sys.executable, sup, "status", "--run-dir", os.path.join(sd, "run")], "supervisor-status.json")
    meta = {"hostname": socket.gethostname(), "uname": " ".join(platform.uname()), "state_dir": sd,
            "current": os.path.basename(cur) if cur else None, "errors": c.errors}
    return {"files": c.files, "meta": meta}


def main(argv: list) -> int:
    a = json.loads(argv[0])
    sys.stdout.write(json.dumps(collect(a["sd"], a["cap"], a["npus"], a["model_dir"])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
