#!/usr/bin/python3
"""Stdlib-only Prometheus exporter on the P/D proxy host, copied there by `kimictl observe up`.

The router copies behind kimictl's proxy front listen on loopback, and vllm-router exports its membership nowhere
Prometheus can read it (its worker-health gauge keeps a worker removed at runtime). This exporter answers, on each
scrape:

- `GET /metrics`: `kimi_proxy_front_up` (the front answers GET /health on the proxy port), and per router copy
  `kimi_proxy_router_up`, `kimi_proxy_router_workers{worker_type}` and one `kimi_proxy_router_worker{url}` per
  worker, from the copy's own membership API on its loopback port (`--membership workers`: vllm-router's
  `GET /workers`; `instances`: vllm-ascend's proxy, whose `POST /instances/add` of nothing lists its instances);
- `GET /router/<i>/metrics`: router copy i's own Prometheus metrics (its loopback --prometheus-port), relayed, so
  a Prometheus on another host can scrape every copy (a router without metrics: an empty answer while the copy
  answers its membership API, so the target's `up` still says whether the copy runs).

Each connection is served within --handler-timeout (then closed, however its client trickles), and at most
--max-clients at once: one more gets 503 at once (a scrape is a few requests every few seconds).
Runs on the hosts' python3 (3.9 or newer).
"""

import argparse
import contextlib
import http.server
import json
import re
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

ROUTER_PATH = re.compile(r"^/router/(\d+)/metrics$")
BUSY_TEXT = b"too many clients at once; retry\n"
BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nRetry-After: 1\r\n"
        b"Connection: close\r\n\r\n%s" % (len(BUSY_TEXT), BUSY_TEXT))
WORKER_TYPES = ("prefill", "decode")


def log(message):
    sys.stderr.write(f"proxy-exporter: {message}\n")
    sys.stderr.flush()


def fetch(url, timeout, body=None):
    """(status, body bytes, content type) of a GET, or a POST of the JSON `body`; status 0 when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), r.headers.get("Content-Type", "text/plain")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), "text/plain"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return 0, str(getattr(exc, "reason", exc)).encode(), "text/plain"


def escape(value):
    return str(value).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def labels(**kv):
    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in kv.items()) + "}" if kv else ""


def workers_of(body):
    """[(worker_type, url, healthy)] from vllm-router's GET /workers answer; None when it is not that shape."""
    try:
        doc = json.loads(body)
        return [(str(w.get("worker_type", "regular")), str(w["url"]).rstrip("/"), bool(w.get("is_healthy", True)))
                for w in doc["workers"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def instances_of(body):
    """[(role, url, healthy)] from vllm-ascend's proxy's /instances/add answer; None when it is not that shape. It
    keeps no health per instance: a listed one counts as healthy."""
    try:
        doc = json.loads(body)
        return [(role, f"http://{x}", True) for role in WORKER_TYPES for x in doc[f"current_{role}_instances"]]
    except (ValueError, KeyError, TypeError):
        return None


# per --membership: (what the probe asks, the JSON it posts or None for a GET, how its answer is read)
MEMBERSHIP = {"workers": ("/workers", None, workers_of),
              "instances": ("/instances/add", {"type": "prefill", "instances": []}, instances_of)}


class Exporter:
    def __init__(self, front_port, routers, timeout, membership="workers", metrics=True):
        self.front_port, self.routers, self.timeout = front_port, routers, timeout
        self.path, self.post, self.parse = MEMBERSHIP[membership]
        self.metrics = metrics

    def collect(self):
        """Exposition text: the front and every router copy, probed in parallel (one scrape, one deadline)."""
        results = {}

        def probe(key, url, body=None):
            results[key] = fetch(url, self.timeout, body)

        jobs = [("front", f"http://127.0.0.1:{self.front_port}/health")]
        jobs += [(i, f"http://127.0.0.1:{port}{self.path}", self.post) for i, (port, _m) in enumerate(self.routers)]
        threads = [threading.Thread(target=probe, args=job, daemon=True) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout + 1)
        lines = [
            "# HELP kimi_proxy_front_up 1 when the proxy front answers GET /health on the proxy port.",
            "# TYPE kimi_proxy_front_up gauge",
            f"kimi_proxy_front_up {1 if results.get('front', (0,))[0] == 200 else 0}",
            "# HELP kimi_proxy_router_up 1 when the router copy answers its membership API on its loopback port.",
            "# TYPE kimi_proxy_router_up gauge",
        ]
        members = {}
        for i, (port, _m) in enumerate(self.routers):
            status, body, _ct = results.get(i, (0, b"", ""))
            members[i] = self.parse(body) if status == 200 else None
            lines.append(f"kimi_proxy_router_up{labels(router=i, port=port)} {0 if members[i] is None else 1}")
        lines += ["# HELP kimi_proxy_router_workers Workers the router copy lists, by worker type.",
                  "# TYPE kimi_proxy_router_workers gauge"]
        for i, ws in members.items():
            if ws is None:
                continue  # unknown is not zero: kimi_proxy_router_up says the copy did not answer
            for wt in sorted(set(WORKER_TYPES) | {w[0] for w in ws}):
                lines.append(f"kimi_proxy_router_workers{labels(router=i, worker_type=wt)} "
                             f"{sum(1 for w in ws if w[0] == wt)}")
        lines += ["# HELP kimi_proxy_router_worker One series per worker a router copy lists: 1 healthy, 0 not.",
                  "# TYPE kimi_proxy_router_worker gauge"]
        for i, ws in members.items():
            for wt, url, healthy in sorted(ws or []):
                lines.append(f"kimi_proxy_router_worker{labels(router=i, worker_type=wt, url=url)} {int(healthy)}")
        return "\n".join(lines) + "\n"

    def relay(self, index):
        """(status, body, content type) of router copy `index`'s own metrics endpoint."""
        if index >= len(self.routers):
            return 404, f"no router copy {index}\n".encode(), "text/plain"
        if not self.metrics:  # a router without metrics of its own: the target is up while the copy answers
            status, body, _ct = fetch(f"http://127.0.0.1:{self.routers[index][0]}{self.path}", self.timeout,
                                      self.post)
            if status != 200 or self.parse(body) is None:
                return 503, f"router copy {index}: {status or 'unreachable'}: {body[:200]!r}\n".encode(), \
                    "text/plain"
            return 200, f"# router copy {index} exports no metrics of its own\n".encode(), \
                "text/plain; version=0.0.4; charset=utf-8"
        status, body, ctype = fetch(f"http://127.0.0.1:{self.routers[index][1]}/metrics", self.timeout)
        if status != 200:
            return 503, f"router copy {index} metrics: {status or 'unreachable'}: {body[:200]!r}\n".encode(), \
                "text/plain"
        return 200, body, ctype


def handler_for(exporter):
    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "kimi-proxy-exporter"

        def do_GET(self):
            path = self.path.partition("?")[0]
            m = ROUTER_PATH.match(path)
            if path == "/metrics":
                status, body, ctype = 200, exporter.collect().encode(), "text/plain; version=0.0.4; charset=utf-8"
            elif m:
                status, body, ctype = exporter.relay(int(m.group(1)))
            elif path == "/":
                status, body, ctype = 200, b"kimictl proxy exporter: /metrics, /router/<i>/metrics\n", "text/plain"
            else:
                status, body, ctype = 404, b"not found\n", "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args):  # scrapes every few seconds: no access log
            pass

    return Handler


class Server(http.server.ThreadingHTTPServer):
    """A thread per connection, at most `max_clients` of them (one more is answered 503 and closed at once), each
    connection closed `deadline` seconds after it was accepted, whatever it is doing then."""

    daemon_threads = True

    def __init__(self, address, handler, max_clients, deadline):
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(max_clients)
        self.deadline = deadline
        self.refused, self.logged_at = 0, 0.0

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            self.refuse(request)
            return
        cut = threading.Timer(self.deadline, self.cut, (request,))
        cut.daemon = True

        def serve():
            try:
                cut.start()
                self.process_request_thread(request, client_address)
            finally:
                cut.cancel()
                self.slots.release()

        threading.Thread(target=serve, daemon=True).start()

    @staticmethod
    def cut(request):
        """The deadline: whatever the handler waits for on this connection ends now."""
        with contextlib.suppress(OSError):
            request.shutdown(socket.SHUT_RDWR)

    def refuse(self, request):
        self.refused += 1
        if time.monotonic() - self.logged_at >= 60:  # a flood costs a line a minute
            log(f"{self.refused} connection(s) refused so far: already serving the most clients at once")
            self.logged_at = time.monotonic()
        with contextlib.suppress(OSError):
            request.setblocking(False)  # never wait on this client: answer what fits, read what came, close
            request.send(BUSY)
            while request.recv(65536):
                pass
        self.shutdown_request(request)

    def handle_error(self, request, client_address):  # a client cut or gone: no traceback
        pass


def router_ports(value):
    port, _, metrics = value.partition(":")
    if not (port.isdigit() and metrics.isdigit()):
        raise argparse.ArgumentTypeError(f"--router wants PORT:METRICS_PORT, got {value!r}")
    return int(port), int(metrics)


def parser():
    p = argparse.ArgumentParser(prog="proxy_exporter.py", description=__doc__.split("\n")[0])
    p.add_argument("--listen", required=True, help="HOST:PORT to serve /metrics on")
    p.add_argument("--front-port", type=int, required=True, help="the proxy port (kimictl's front)")
    p.add_argument("--router", type=router_ports, action="append", default=[],
                   help="a router copy's loopback PORT:METRICS_PORT, in the front's order (repeat)")
    p.add_argument("--timeout", type=float, default=1.5, help="per probe, seconds (keep under the scrape timeout)")
    p.add_argument("--membership", choices=sorted(MEMBERSHIP), default="workers",
                   help="the router kind's membership API (vllm-router: workers; vllm-ascend-proxy: instances)")
    p.add_argument("--no-router-metrics", action="store_true", help="the router copies have no metrics port")
    p.add_argument("--handler-timeout", type=float, default=10.0,
                   help="seconds a connection is served at most, from its accept (then closed)")
    p.add_argument("--max-clients", type=int, default=16, help="connections served at once; one more gets 503")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if not (args.handler_timeout > 0 and args.max_clients > 0):
        parser().error("--handler-timeout and --max-clients must be positive")
    host, _, port = args.listen.rpartition(":")
    handler = handler_for(Exporter(args.front_port, args.router, args.timeout, args.membership,
                                   not args.no_router_metrics))
    handler.timeout = args.handler_timeout  # each read and write on the connection, within the deadline below
    server = Server((host, int(port)), handler, args.max_clients, args.handler_timeout)

    def stop(*_):
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log(f"serving on {args.listen}: front port {args.front_port}, {len(args.router)} router copies "
        f"({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())})")
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
