#!/usr/bin/python3 -IS
"""Test double of Ascend's NPU-Exporter (MindCluster): Prometheus metrics of the sandbox host's NPUs.

Serves `GET /metrics` on `-ip`/`-port` (the real exporter's flags; default port 8082, plain HTTP as with its
`-enableHTTP=true`) with the real metric names and labels (Ascend/ascend-npu-exporter collector/npu_collector.go,
collector/testdata/prometheus_metrics): health, device-NIC link and network status, HBM used/total in MB. The
answers come from the same host state the npu-smi and hccn_tool doubles read, so `sandbox fault link-down:H:N`
and `npu-unhealthy:H:N` show here too, and HBM follows the NPUs engines claim. Stdlib only.
"""

import argparse
import http.server
import importlib.machinery
import importlib.util
import os
import sys

CHIP_MODEL = {"910B3": "910B3-Ascend-V1"}   # npu-smi chip name -> the exporter's model_name label


def _npu_smi():
    """The npu-smi double's module: installed as `npu-smi` next to this file on a sandbox host, `npu_smi.py` here."""
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("npu-smi", "npu_smi.py"):
        path = os.path.join(here, name)
        if os.path.exists(path):
            loader = importlib.machinery.SourceFileLoader("kimi_sim_npu_smi", path)
            spec = importlib.util.spec_from_loader(loader.name, loader)
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            return module
    raise SystemExit(f"npu-exporter: the npu-smi double is not next to {here}")


npu_smi = _npu_smi()


def gauge(out, name, doc, rows):
    out.append(f"# HELP {name} {doc}")
    out.append(f"# TYPE {name} gauge")
    for labels, value in rows:
        body = ",".join(f'{k}="{v}"' for k, v in labels.items())
        out.append(f"{name}{{{body}}} {value}" if body else f"{name} {value}")


def metrics():
    """The exposition text for the host's current state (read on every scrape, like the doubles)."""
    host = npu_smi.load_host()
    faults = npu_smi.load_json("faults.json", {})
    claims = npu_smi.live_claims(host)
    model = CHIP_MODEL.get(host["chip_name"], f"{host['chip_name']}-Ascend-V1")
    npus = range(host["npus"])

    def lab(n):
        return {"id": n, "model_name": model, "pcie_bus_info": host["bus_ids"][n], "vdie_id": ""}

    down = set(faults.get("link_down") or [])
    out = []
    gauge(out, "machine_npu_nums", "Amount of npu installed on the machine.", [({}, host["npus"])])
    gauge(out, "npu_chip_info_health_status", "the npu health status",
          [(lab(n), 1 if npu_smi.health(host, faults, n) == "OK" else 0) for n in npus])
    gauge(out, "npu_chip_info_link_status", "the npu link status", [(lab(n), 0 if n in down else 1) for n in npus])
    gauge(out, "npu_chip_info_network_status", "the npu network health status",
          [(lab(n), 0 if n in down else 1) for n in npus])
    gauge(out, "npu_chip_info_hbm_total_memory", "the npu hbm total memory", [(lab(n), host["hbm_mb"]) for n in npus])
    gauge(out, "npu_chip_info_hbm_used_memory", "the npu hbm used memory",
          [(lab(n), npu_smi.hbm_used(host, claims, n)) for n in npus])
    gauge(out, "npu_exporter_version_info", "exporter version with value '1'",
          [({"exporterVersion": "kimictl-sandbox-double"}, 1)])
    return "\n".join(out) + "\n"


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.partition("?")[0] != "/metrics":
            code, body = 404, b"NPU-Exporter (sandbox double): /metrics\n"
        else:
            try:
                code, body = 200, metrics().encode()
            except (OSError, ValueError, KeyError, SystemExit) as exc:
                code, body = 500, f"npu-exporter: {exc}\n".encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *args):
        pass


def main(argv=None):
    p = argparse.ArgumentParser(prog="npu-exporter", description="NPU-Exporter test double")
    p.add_argument("-ip", required=True, help="listen IP (the real exporter requires it too)")
    p.add_argument("-port", type=int, default=8082)
    p.add_argument("-enableHTTP", default="true", help="accepted for the real command line; always plain HTTP")
    args = p.parse_args(argv)
    server = http.server.ThreadingHTTPServer((args.ip, args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
