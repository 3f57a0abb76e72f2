"""A stand-in for vllm-router in the proxy front's tests: parses the flags the front gives it (the last one wins,
like argparse), answers /health, /healthcheck (with its argv), /workers, /whoami and /v1/whoami (the credential
headers it got) and /v1/completions (slowly with ?slow, streamed with "stream": true), drops a worker on
`POST /remove_worker?url=` (vllm-router's admin API) or `POST /instances/remove` (vllm-ascend's proxy's), and on
SIGTERM stops listening and finishes in-flight requests, as vllm-router does.
With FAKE_ROUTER_FAIL_FILE set and that file present it exits at once (a router that cannot start); with
FAKE_ROUTER_DROP_EVERY=N it closes a keep-alive connection without an answer on every Nth request (the race of a
router closing an idle connection just as a request arrives)."""

import argparse
import http.server
import json
import os
import signal
import sys
import threading
import time
import urllib.parse

ap = argparse.ArgumentParser()
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--port", type=int, default=30000)
ap.add_argument("--prometheus-port", type=int)
ap.add_argument("--policy")
args, _ = ap.parse_known_args()

WORKERS = ["http://10.0.0.1:7100", "http://10.0.0.2:7100"]
DROP_EVERY = int(os.environ.get("FAKE_ROUTER_DROP_EVERY", "0"))
fail = os.environ.get("FAKE_ROUTER_FAIL_FILE")
if fail and os.path.exists(fail):
    sys.exit(3)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 0.5  # idle keep-alive connections close soon, as a shutting-down vllm-router closes them at once

    def log_message(self, *a):
        pass

    def reply(self, code, doc):
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if stopping.is_set():
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        if self.path == "/health":
            self.reply(200, {"ok": True})
        elif self.path == "/healthcheck":  # vllm-ascend's proxy's health answer
            self.reply(200, {"status": "ok", "prefill_instances": 1, "decode_instances": 1, "request_num": 0,
                             "argv": sys.argv[1:]})
        elif self.path == "/workers":
            self.reply(200, {"workers": [{"url": u, "worker_type": "prefill"} for u in WORKERS]})
        elif self.path.startswith(("/whoami", "/v1/whoami")):
            self.reply(200, {"port": args.port, "pid": os.getpid(), "path": self.path,
                             "auth": self.headers.get("Authorization"), "x_api_key": self.headers.get("X-Api-Key"),
                             "proxy_auth": self.headers.get("Proxy-Authorization")})
        else:
            self.reply(404, {"error": self.path})

    def do_POST(self):
        # Counted, kept only when small: a test streams hundreds of MiB through.
        want, got, body = int(self.headers.get("Content-Length", 0)), 0, b""
        while got < want:
            chunk = self.rfile.read(min(want - got, 1 << 20))
            if not chunk:
                self.close_connection = True
                return  # the front gave up on this request (its client was too slow or went away)
            got += len(chunk)
            body = body + chunk if want <= 1 << 20 else b""
        self.served = getattr(self, "served", 0) + 1
        if DROP_EVERY and self.served % DROP_EVERY == 0:
            self.close_connection = True
            return
        url = urllib.parse.urlsplit(self.path)
        if url.path in ("/remove_worker", "/instances/remove"):
            gone = urllib.parse.parse_qs(url.query).get("url") or json.loads(body or b"{}").get("instances", [])
            WORKERS[:] = [u for u in WORKERS if u not in gone]
            self.reply(200, {"workers": WORKERS})
            return
        doc = json.loads(body or b"{}")
        if "slow" in self.path:
            time.sleep(1.0)
        if doc.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                data = f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"0\r\n\r\n")
            return
        self.reply(200, {"choices": [{"text": f"router {args.port}"}], "echo_bytes": got})


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = False
    block_on_close = True


stopping = threading.Event()
server = Server((args.host, args.port), Handler)


def on_term(signum, frame):
    stopping.set()
    threading.Thread(target=server.shutdown).start()


signal.signal(signal.SIGTERM, on_term)
server.serve_forever()
server.server_close()  # stop listening; block_on_close joins the in-flight request threads
