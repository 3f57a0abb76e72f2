"""`status` compares each router copy behind the proxy with the deployed endpoints."""

from __future__ import annotations

import http.server
import json
import threading

from kimictl.status import EngineStatus, ProxyStatus, StatusReport, _membership

ENGINES = [EngineStatus(host="h", state="ready", **e) for e in (
    {"id": "prefill-0-dp0", "role": "prefill", "ip": "10.0.0.1", "port": 7100, "serves_http": True},
    {"id": "decode-0-dp0", "role": "decode", "ip": "10.0.0.2", "port": 7100, "serves_http": True},
    {"id": "decode-0-dp1", "role": "decode", "ip": "10.0.0.2", "port": 7101, "serves_http": True},
    {"id": "decode-0-n1", "role": "decode", "ip": "10.0.0.3", "port": 7100, "serves_http": False},
)]
LISTS = {
    "/kimictl/router/0/workers": ["http://10.0.0.1:7100", "http://10.0.0.2:7100", "http://10.0.0.2:7101"],
    "/kimictl/router/1/workers": ["http://10.0.0.1:7100/", "http://10.0.0.2:7100", "http://10.9.9.9:7100"],
}


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        """vllm-ascend's proxy: an /instances/add of nothing answers with the current instances."""
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        prefix = self.path.removesuffix("/instances/add")
        urls = LISTS.get(f"{prefix}/workers") if self.path.endswith("/instances/add") else None
        ok = self.headers.get("Authorization") == "Bearer k" and urls and body.get("instances") == []
        doc = {"message": "add prefill instances: [].",
               "current_prefill_instances": [u.removeprefix("http://").rstrip("/") for u in urls if "7100" in u
                                             and "10.0.0.1" in u],
               "current_decode_instances": [u.removeprefix("http://").rstrip("/") for u in urls if "10.0.0.1" not in u]
               } if ok else {"detail": "Not Found"}
        raw = json.dumps(doc).encode()
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        if self.headers.get("Authorization") != "Bearer k":
            self.send_response(401)
            self.end_headers()
            return
        urls = LISTS.get(self.path)
        body = json.dumps({"workers": [{"url": u} for u in urls]} if urls else {"error": "no"}).encode()
        self.send_response(200 if urls else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_each_copy_is_checked_against_the_deployed_endpoints() -> None:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        for kind in ("vllm-router", "vllm-ascend-proxy"):  # GET /workers, or the instances an empty add lists
            proxy = ProxyStatus(host="h", ip="127.0.0.1", port=srv.server_address[1], routers=3, router=kind,
                                state="ready")
            got = [m.to_json() for m in _membership(ENGINES, proxy, "k")]
            assert got[0] == {"router": 0, "members": 3, "missing": [], "unknown": []}, kind
            assert got[1] == {"router": 1, "members": 3, "missing": ["decode-0-dp1"],
                              "unknown": ["http://10.9.9.9:7100"]}, kind
            assert got[2]["router"] == 2 and "404" in got[2]["error"], kind
            assert ("401" if kind == "vllm-router" else "404") in _membership(ENGINES, proxy, None)[0].error
    finally:
        srv.shutdown()


def test_status_view_names_router_copies_that_lack_endpoints() -> None:
    from rich.console import Console

    from kimictl.cli.views import status_view

    doc = {"schema_version": 1, "cluster": "c", "state": "degraded", "served_model_name": None, "release": "r",
           "engines": [], "pairs": [], "drift": [], "monitoring": None, "at": "",
           "proxy": {"host": "h1", "ip": "10.0.0.1", "port": 8000, "routers": 2, "router": "vllm-router",
                     "state": "ready",
                     "membership": [{"router": 0, "members": 3, "missing": [], "unknown": []},
                                    {"router": 1, "members": 2, "missing": ["decode-0-dp1"], "unknown": []}]}}
    con = Console(width=200, record=True)
    con.print(status_view(StatusReport.model_validate(doc)))
    text = con.export_text()
    assert "router copies list 3/2 endpoint(s)" in text
    assert "router 1 behind the proxy lacks decode-0-dp1" in text


def test_stale_engine_ids_name_the_restarted_prefill_until_the_routers_know() -> None:
    from kimictl.status import _stale_engine_ids

    url_a, url_b = "http://10.0.0.1:36000/query", "http://10.0.0.2:36000/query"
    known = {url_a: ["e1"], url_b: ["e2"]}
    assert _stale_engine_ids(None) is None
    assert _stale_engine_ids({"engine_ids": None, "routers_know": known}) is None  # a prefill is down: no news
    assert _stale_engine_ids({"engine_ids": known, "routers_know": known}) is None
    why = _stale_engine_ids({"engine_ids": {url_a: ["e1"], url_b: ["e3"]}, "routers_know": known})
    assert why is not None and "10.0.0.2:36000" in why and "10.0.0.1" not in why and "restarts them" in why
