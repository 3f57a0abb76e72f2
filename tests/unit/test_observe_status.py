"""`kimictl status` says where Prometheus runs (from the last `observe up`), whether it answers, and what fires."""

from __future__ import annotations

import http.server
import json
import socket
import threading

import pytest

from kimictl.observe_up import monitoring_status, record

ALERTS = {"status": "success", "data": {"alerts": [
    {"labels": {"alertname": "KimiEngineDown", "cluster": "c1"}, "state": "firing"},
    {"labels": {"alertname": "KimiEngineDown", "cluster": "c1"}, "state": "firing"},
    {"labels": {"alertname": "KimiHBMNearFull", "cluster": "c1"}, "state": "pending"},
    {"labels": {"alertname": "KimiProxyDown", "cluster": "other"}, "state": "firing"}]}}


class Prom(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        body = {"/-/ready": b"Prometheus Server is Ready.\n",
                "/api/v1/alerts": json.dumps(ALERTS).encode()}.get(self.path, b"")
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path))


def test_no_observe_up_no_monitoring_line(state):
    assert monitoring_status("c1") is None


def test_ready_prometheus_and_this_clusters_firing_alerts(state):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Prom)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        record("c1", {"prometheus_url": url, "monitor_host": "atlas-01", "targets": 14})
        got = monitoring_status("c1")
        assert got == {"prometheus_url": url, "monitor_host": "atlas-01", "targets": 14, "state": "ready",
                       "alerts_firing": ["KimiEngineDown"]}
    finally:
        srv.shutdown()
        srv.server_close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    record("c1", {"prometheus_url": f"http://127.0.0.1:{closed}", "monitor_host": "atlas-01", "targets": 14})
    assert monitoring_status("c1", timeout=1)["state"] == "unreachable"


def test_status_view_prints_one_monitoring_line():
    from rich.console import Console

    from kimictl.cli.views import status_view
    from kimictl.status import StatusReport

    doc = {"schema_version": 1, "cluster": "c", "state": "healthy", "served_model_name": None, "release": "r",
           "engines": [], "pairs": [], "drift": [], "proxy": None, "at": "",
           "monitoring": {"prometheus_url": "http://10.0.0.1:9090", "monitor_host": "atlas-01", "targets": 14,
                          "state": "ready", "alerts_firing": ["KimiEngineDown", "KimiTargetDown"]}}
    con = Console(width=200, record=True)
    con.print(status_view(StatusReport.model_validate(doc)))
    lines = [ln for ln in con.export_text().splitlines() if "monitoring" in ln]
    assert lines == ["monitoring: Prometheus http://10.0.0.1:9090 on atlas-01: ready, firing KimiEngineDown, "
                     "KimiTargetDown"]
    doc["monitoring"] = None
    con = Console(width=200, record=True)
    con.print(status_view(StatusReport.model_validate(doc)))
    assert "monitoring" not in con.export_text()
