"""Print the real-engine lane's P/D figures per KV connector: start-up, first request, steady-state latency.

Brings up a 2-host sandbox, generates the tiny Kimi-shaped checkpoint with the lane's python, and deploys the lane's
1P1D (tests/real_engine/topologies/cpu-smoke-pd.yml: prefill on one host, decode on the other, behind the profile's
default proxy: vllm-ascend's for NIXL, vllm-router for Mooncake) once per connector, then stops it:
  start-up       `kimictl deploy` wall time, and the part spent waiting for both engines to answer
  first request  deploy's smoke test: the first completion through the proxy after the engines started (400-word
                 prompt, 16 tokens; includes the connector's first handshake/bootstrap query)
  steady state   --requests sequential completions through the proxy (300-word prompt, 8 tokens), end to end
Needs root and the lane (`bash scripts/vllm_lane.sh`). The figures mean something on a quiet machine only: the load
average is printed before and after (take them below ~1.5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from kimictl import health
from kimictl.facts import engine_profile
from kimictl.sandbox.cluster import Sandbox

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = ROOT / "tests/real_engine/topologies/cpu-smoke-pd.yml"
LANE = os.environ.get("KIMICTL_VLLM_PYTHON", "/var/tmp/kimictl-vllm-venv/bin/python")


class Failed(Exception):
    pass


def kimictl(env: dict[str, str], *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "kimictl", *args, "--output", "json"], capture_output=True,
                          text=True, env=env, check=False, timeout=1800)
    if proc.returncode != 0:
        raise Failed(f"kimictl {' '.join(args[:1])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout) if proc.stdout.strip() else {}


def engine_logs(sandbox_dir: Path, lines: int = 40) -> str:
    """The last errors and warnings of each lane engine's log on the sandbox hosts (a failed deploy leaves them)."""
    out = []
    for host, name in (("atlas-01", "prefill-0-dp0"), ("atlas-02", "decode-0-dp0")):
        tail = subprocess.run(["ssh", "-F", str(sandbox_dir / "ssh_config"), host,
                               f"grep -E 'ERROR|WARNING|Traceback|Error' /var/lib/kimi/logs/{name}.log "
                               f"| grep -v -E 'leaked|nanobind|ulimit' | tail -n {lines}"],
                              capture_output=True, text=True, check=False, timeout=60).stdout
        out.append(f"--- {host} {name}.log\n{tail}")
    return "\n".join(out)


def lane_inventory(sandbox_dir: Path, model_dir: Path, connector: str, out: Path) -> Path:
    doc = yaml.safe_load((sandbox_dir / "inventory.yml").read_text())
    v = doc["all"]["vars"]
    for key in ("kimi_model_id", "kimi_model_endpoint"):
        v.pop(key, None)
    v.update({"kimi_cluster": f"lane-{connector}", "kimi_engine_profile": "cpu-smoke", "kimi_engine_command": LANE,
              "kimi_model_source": "local", "kimi_model_dir": str(model_dir), "kimi_kv_connector": connector})
    path = out / f"lane-{connector}.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def measure(env: dict[str, str], inv: Path, requests: int) -> dict:
    t0 = time.monotonic()
    doc = kimictl(env, "deploy", "-i", str(inv), "--topology", str(TOPOLOGY), "--yes")
    wall = time.monotonic() - t0
    try:
        url = doc["smoke"]["url"]
        served = engine_profile("cpu-smoke").facts().served_model_name
        latencies = []
        for _ in range(requests):
            t = time.monotonic()
            code, body = health.http_post_json(url, {"model": served, "prompt": health.smoke_prompt(300, nonce=True),
                                                     "max_tokens": 8, "temperature": 0}, timeout=300)
            if code != 200:
                raise Failed(f"completion through {url}: HTTP {code}: {str(body)[:300]}")
            latencies.append(time.monotonic() - t)
    finally:
        kimictl(env, "stop", "-i", str(inv), "--yes")
    q = statistics.quantiles(latencies, n=10) if len(latencies) > 1 else latencies * 9
    return {"deploy": wall, "engines_ready": doc["seconds"].get("engines_ready"), "first": doc["seconds"]["smoke"],
            "p50": statistics.median(latencies), "p90": q[8], "tokens": doc["smoke"]["prompt_tokens"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connectors", nargs="+", default=["nixl", "mooncake"])
    ap.add_argument("--requests", type=int, default=20)
    args = ap.parse_args()
    if not Path(LANE).exists():
        print(f"no lane at {LANE}: run scripts/vllm_lane.sh", file=sys.stderr)
        return 2
    print(f"load average before: {os.getloadavg()[0]:.2f} (figures are meaningful below ~1.5)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="kimictl-bench-lane-", dir="/tmp") as tmp:  # /tmp: the hosts see it
        out = Path(tmp)
        env = {**os.environ, "KIMICTL_STATE_DIR": str(out / "state"), "PYTHONPATH": str(ROOT)}
        model = out / "Kimi-K2.5-tiny"
        subprocess.run([LANE, "-m", "kimictl.sandbox.tiny_model", str(model)], check=True, env=env,
                       capture_output=True, timeout=900)
        sb = Sandbox(out / "sb")
        sb.up(2, "atlas-800-a3")
        try:
            for connector in args.connectors:
                try:
                    results[connector] = measure(env, lane_inventory(out / "sb", model, connector, out),
                                                 args.requests)
                except Failed as exc:
                    print(f"{connector}: {exc}\n{engine_logs(out / 'sb')}", file=sys.stderr)
                    return 1
        finally:
            sb.down()
    print(f"load average after:  {os.getloadavg()[0]:.2f}")
    print(f"lane P/D (1 prefill + 1 decode host, vLLM CPU {LANE}), {args.requests} steady-state requests")
    print(f"{'connector':<10} {'deploy':>8} {'engines':>8} {'first req':>10} {'p50':>7} {'p90':>7}")
    for name, r in results.items():
        print(f"{name:<10} {r['deploy']:7.1f}s {r['engines_ready']:7.1f}s {r['first']:9.2f}s {r['p50']:6.2f}s "
              f"{r['p90']:6.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
