#!/usr/bin/python3
"""Stdlib-only front of the P/D proxy, copied to hosts next to the supervisor.

It owns the proxy's public port and runs N copies of the router on loopback ports. Each client connection goes to
a router that is up (another one when a connect is refused). SIGHUP restarts the routers one at a time, each
gracefully (in-flight requests finish), so a router that cannot add workers at runtime (vllm-router in static P/D
mode) takes back drained workers while clients never see a refused connection. With --api-key-file, every request
except `GET /health` must carry `Authorization: Bearer <key>` (vllm-router does not check client keys).
`/kimictl/router/<i>/<path>` reaches router i's own API (drain, membership), behind the same key.
With --watch URL, routers that learn the prefill engines' ids once, at their start (vllm-router asks Mooncake
bootstrap servers), are restarted the same way when the engine ids those URLs list change (a prefill engine
restarted under a new id); the state file tells what the routers know meanwhile.
"""

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import re
import signal
import sys
import time
import urllib.request

ADMIN_RE = re.compile(rb"^/kimictl/router/(\d+)(/.*)?$")
MAX_HEADER = 64 * 1024
MAX_BODY = 256 * 1024 * 1024
COPY_CHUNK = 256 * 1024
BACKOFF_MAX = 30.0


def log(message):
    sys.stderr.write(f"proxy-front: {message}\n")
    sys.stderr.flush()


def write_json_atomic(path, doc):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def response(code, reason, text, close=True):
    body = (json.dumps({"error": {"message": text, "code": code}}) + "\n").encode()
    head = (f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            + ("Connection: close\r\n" if close else "") + "\r\n")
    return head.encode() + body


def engine_ids(urls):
    """{url: sorted engine ids} from each URL's JSON (every "engine_id" value in it); None if one does not answer."""
    out = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=3) as r:
                doc = json.load(r)
        except (OSError, ValueError):
            return None
        found, todo = [], [doc]
        while todo:
            item = todo.pop()
            if isinstance(item, dict):
                found += [str(v) for k, v in item.items() if k == "engine_id"]
                todo += [v for v in item.values() if isinstance(v, (dict, list))]
            elif isinstance(item, list):
                todo += item
        if not found:
            return None  # a bootstrap server with no engine registered yet
        out[url] = sorted(found)
    return out


class HttpError(Exception):
    def __init__(self, code, reason, text):
        super().__init__(text)
        self.code, self.reason, self.text = code, reason, text


class Request:
    """One HTTP/1.1 request head as the client sent it."""

    def __init__(self, raw):
        lines = raw.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            raise HttpError(400, "Bad Request", "malformed request line")
        self.method, self.target, self.version = parts
        self.headers = lines[1:]
        self.fields = {}
        for line in self.headers:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise HttpError(400, "Bad Request", "malformed header line")
            self.fields.setdefault(name.strip().lower(), []).append(value.strip())
        te = self.fields.get(b"transfer-encoding")
        lengths = set(self.fields.get(b"content-length", []))
        if te:
            raise HttpError(411, "Length Required", "chunked request bodies are not accepted; send Content-Length")
        if len(lengths) > 1 or (lengths and not next(iter(lengths)).isdigit()):
            raise HttpError(400, "Bad Request", "bad Content-Length")
        self.length = int(next(iter(lengths))) if lengths else 0
        # Answered here (the body is read before the router sees the request), so the router must not see it.
        self.expects_continue = any(v.lower() == b"100-continue" for v in self.fields.get(b"expect", []))
        if self.expects_continue:
            self.headers = [h for h in self.headers if h.partition(b":")[0].strip().lower() != b"expect"]

    def header(self, name):
        values = self.fields.get(name)
        return values[-1] if values else None

    def target_router(self):
        """(router index, target to send) for /kimictl/router/<i>/...; (None, target) otherwise."""
        path, q, query = self.target.partition(b"?")
        m = ADMIN_RE.match(path)
        if not m:
            return None, self.target
        return int(m.group(1)), (m.group(2) or b"/") + q + query

    def encode(self, target):
        return b"\r\n".join([b" ".join([self.method, target, self.version]), *self.headers]) + b"\r\n\r\n"


class NothingSent(Exception):
    """The router closed the connection before any byte of a response."""


class Upstream:
    """The connection a client's current request uses: to one router (index None: any)."""

    def __init__(self, index, router, reader, writer):
        self.index, self.router, self.reader, self.writer = index, router, reader, writer
        self.closed = False
        router.active += 1

    def close(self):
        if not self.closed:
            self.closed = True
            self.router.active -= 1
            self.writer.close()


class Router:
    def __init__(self, index, port, metrics_port, argv):
        self.index, self.port, self.metrics_port = index, port, metrics_port
        # argparse takes the last of a repeated flag: these override whatever the rendered command says.
        self.argv = [*argv, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port)]
        self.proc = None
        self.state = "stopped"
        self.accepting = False
        self.restarts = 0
        self.active = 0
        self.started_at = None
        self.exited = asyncio.Event()
        self.ready = asyncio.Event()
        self.restart_now = asyncio.Event()

    def doc(self):
        return {"index": self.index, "port": self.port, "metrics_port": self.metrics_port, "state": self.state,
                "pid": self.proc.pid if self.proc and self.proc.returncode is None else None,
                "restarts": self.restarts, "active": self.active, "started_at": self.started_at}


class Front:
    def __init__(self, args, argv):
        self.args = args
        self.routers = [Router(i, p, m, argv) for i, (p, m) in enumerate(args.router)]
        self.rr = 0
        self.stopping = False
        self.requested = 0  # SIGHUPs seen
        self.completed = 0  # reloads finished (done or failed), by sequence number
        self.last = {"seq": 0, "state": "idle", "error": None, "seconds": None}
        self.reload_wanted = asyncio.Event()
        self.key = None
        self.key_mtime = None
        # --watch: the engine ids the URLs list now, and the ones every router learnt at its last (re)start
        self.watch = {"urls": list(args.watch), "engine_ids": None, "routers_know": None, "checked_at": None,
                      "changed_at": None}

    # --- state file -----------------------------------------------------------------------------------------

    def save(self):
        write_json_atomic(self.args.state, {
            "pid": os.getpid(), "listen": self.args.listen, "requested": self.requested, "completed": self.completed,
            "reload": self.last, "routers": [r.doc() for r in self.routers],
            "api_key": self.args.api_key_file is not None, "watch": self.watch if self.args.watch else None,
        })

    # --- routers --------------------------------------------------------------------------------------------

    async def healthy(self, r):
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", r.port), 2)
        except (OSError, asyncio.TimeoutError):
            return False
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            line = await asyncio.wait_for(reader.readline(), 3)
            return line.split(b" ")[1:2] == [b"200"]
        except (OSError, asyncio.TimeoutError, IndexError):
            return False
        finally:
            writer.close()

    async def run_router(self, r):
        """Keep router r running: start, wait until /health answers, serve; on a crash restart with backoff."""
        failures = 0
        while not self.stopping:
            r.exited.clear()
            r.ready.clear()
            r.state = "starting"
            try:
                r.proc = await asyncio.create_subprocess_exec(*r.argv, stdin=asyncio.subprocess.DEVNULL)
            except OSError as exc:
                log(f"router {r.index}: cannot start {r.argv[0]}: {exc}")
                r.proc = None
            else:
                r.started_at = time.time()
                log(f"router {r.index} (port {r.port}) started, pid {r.proc.pid}")
            self.save()
            while r.proc and r.proc.returncode is None and not r.accepting:
                if await self.healthy(r):
                    r.accepting, r.state = True, "ready"
                    r.ready.set()
                    failures = 0
                    log(f"router {r.index} (port {r.port}) ready")
                    self.save()
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(r.proc.wait(), 0.25)
            code = await r.proc.wait() if r.proc else None
            r.accepting = False
            r.exited.set()
            if self.stopping:
                r.state = "stopped"
                self.save()
                return
            if r.restart_now.is_set():
                r.restart_now.clear()
                log(f"router {r.index} exited ({code}) for a reload")
                r.restarts += 1
                continue
            failures += 1
            r.restarts += 1
            delay = min(BACKOFF_MAX, 2.0 ** (failures - 1))
            r.state = "backoff"
            log(f"router {r.index} (port {r.port}) exited with {code}; restarting in {delay:.0f}s")
            self.save()
            try:
                await asyncio.wait_for(r.restart_now.wait(), delay)
                r.restart_now.clear()
            except asyncio.TimeoutError:
                pass

    async def stop_router(self, r):
        """SIGTERM: vllm-router stops listening at once and finishes its in-flight requests; SIGKILL after grace."""
        r.accepting = False
        r.state = "stopping"
        if not r.proc or r.proc.returncode is not None:
            return
        r.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(r.exited.wait(), self.args.grace)
        except asyncio.TimeoutError:
            log(f"router {r.index} still running {self.args.grace:.0f}s after SIGTERM; killing it")
            r.proc.kill()
            await r.exited.wait()

    async def reloader(self):
        while True:
            await self.reload_wanted.wait()
            self.reload_wanted.clear()
            seq = self.requested
            t0 = time.monotonic()
            self.last = {"seq": seq, "state": "running", "error": None, "seconds": None}
            self.save()
            error = await self.rolling_restart()
            self.last = {"seq": seq, "state": "failed" if error else "done", "error": error,
                         "seconds": round(time.monotonic() - t0, 2)}
            self.completed = seq
            log(f"reload {seq}: {error or 'done'}")
            self.save()

    async def rolling_restart(self):
        for r in self.routers:
            others = [o for o in self.routers if o is not r and o.accepting]
            if not others and len(self.routers) > 1:
                return f"router {r.index} not restarted: no other router is up to take its clients"
            r.restart_now.set()
            await self.stop_router(r)
            try:
                await asyncio.wait_for(r.ready.wait(), self.args.ready_timeout)
            except asyncio.TimeoutError:
                return f"router {r.index} (port {r.port}) not ready {self.args.ready_timeout:.0f}s after its restart"
        return None

    async def watcher(self):
        """--watch: restart the routers when the prefill engine ids they learnt at their start are stale."""
        w = self.watch
        while not self.stopping:
            ids = await asyncio.get_running_loop().run_in_executor(None, engine_ids, w["urls"])
            w["checked_at"] = time.time()
            if ids is not None:
                w["engine_ids"] = ids
                if w["routers_know"] is None:
                    if all(r.accepting for r in self.routers):
                        w["routers_know"] = ids  # first sight: the routers just asked the same servers
                elif ids != w["routers_know"]:
                    w["changed_at"] = time.time()
                    log(f"prefill engine ids changed ({w['routers_know']} -> {ids}); restarting the routers")
                    self.requested += 1
                    seq = self.requested
                    self.reload_wanted.set()
                    self.save()
                    while self.completed < seq and not self.stopping:
                        await asyncio.sleep(0.5)
                    if self.last.get("state") == "done":
                        w["routers_know"] = ids
            self.save()
            await asyncio.sleep(self.args.watch_interval)

    # --- clients --------------------------------------------------------------------------------------------

    def api_key(self):
        path = self.args.api_key_file
        if path is None:
            return None
        try:
            st = os.stat(path)
            if st.st_mtime != self.key_mtime:  # re-read on change: a key rotates without a restart
                with open(path) as f:
                    self.key, self.key_mtime = f.read().strip().encode(), st.st_mtime
        except OSError as exc:
            log(f"cannot read the API key file: {exc}")
            self.key = None
        return self.key

    def authorized(self, req):
        if self.args.api_key_file is None:
            return True
        if req.method in (b"GET", b"HEAD") and req.target.partition(b"?")[0] == b"/health":
            return True  # for load balancers and liveness probes, as vLLM's own --api-key leaves it open
        key = self.api_key()
        return bool(key) and hmac.compare_digest(req.header(b"authorization") or b"", b"Bearer " + key)

    async def connect(self, index):
        """Connect to router `index`, or to any accepting router (round robin, failing over), waiting a while
        when none is up (all restarting) instead of refusing the client."""
        deadline = time.monotonic() + self.args.connect_wait
        while not self.stopping:
            if index is not None:
                order = [self.routers[index]] if index < len(self.routers) else []
            else:
                self.rr += 1
                order = [r for r in self.routers[self.rr % len(self.routers):] + self.routers[:self.rr %
                         len(self.routers)] if r.accepting]
            for r in order:
                try:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", r.port), 5)
                    return r, reader, writer
                except (OSError, asyncio.TimeoutError):
                    continue
            if index is not None and not order:
                raise HttpError(404, "Not Found", f"no router {index}")
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        raise HttpError(503, "Service Unavailable", "no router is up")

    async def read_request(self, reader):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial.strip():
                raise HttpError(400, "Bad Request", "incomplete request") from None
            return None
        except asyncio.LimitOverrunError:
            raise HttpError(431, "Request Header Fields Too Large", "request head too large") from None
        return Request(head[:-4])

    async def handle(self, creader, cwriter):
        """Serve one client connection, a request at a time. The upstream connection may change between requests
        (a router that shuts down closes it), so a router restart never reaches a client between two requests."""
        up = None
        try:
            while True:
                req = await self.read_request(creader)
                if req is None:
                    break
                if not self.authorized(req):
                    raise HttpError(401, "Unauthorized", "missing or wrong API key (Authorization: Bearer ...)")
                if req.length > MAX_BODY:
                    raise HttpError(413, "Content Too Large", f"request body over {MAX_BODY} bytes")
                if req.expects_continue:
                    cwriter.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = await creader.readexactly(req.length) if req.length else b""
                index, target = req.target_router()
                data = req.encode(target) + body
                for attempt in (1, 2):
                    if up and (up.index != index or up.reader.at_eof()):
                        up.close()
                        up = None
                    if up is None:
                        up = Upstream(index, *await self.connect(index))
                    up.writer.write(data)
                    try:
                        await up.writer.drain()
                        keep_up, keep_client = await self.relay_response(up, cwriter, req.method)
                        break
                    except NothingSent:
                        # A router shutting down closes idle connections and drops the ones still in its accept
                        # queue without reading them; nothing reached the client yet, so send once more elsewhere.
                        up.close()
                        up = None
                        if attempt == 2:
                            raise HttpError(502, "Bad Gateway", "the router closed the connection") from None
                if not keep_up:
                    up.close()
                    up = None
                if not keep_client:
                    break
        except HttpError as exc:
            if not cwriter.is_closing():
                cwriter.write(response(exc.code, exc.reason, exc.text))
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            if up:
                up.close()
            cwriter.close()

    async def relay_response(self, up, cwriter, method):
        """Copy one response (after any 1xx) to the client as it arrives; (keep upstream, keep client)."""
        while True:
            try:
                head = await up.reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                raise NothingSent() from exc
            except asyncio.LimitOverrunError:
                raise HttpError(502, "Bad Gateway", "the router's response head is too large") from None
            lines = head[:-4].split(b"\r\n")
            parts = lines[0].split(b" ", 2)
            if len(parts) < 2 or not parts[1].isdigit():
                raise HttpError(502, "Bad Gateway", "malformed response from the router")
            status = int(parts[1])
            fields = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                fields.setdefault(name.strip().lower(), []).append(value.strip().lower())
            if 100 <= status < 200:
                if status == 101:
                    raise HttpError(502, "Bad Gateway", "protocol upgrades are not proxied")
                cwriter.write(head)
                continue
            closing = any(b"close" in v for v in fields.get(b"connection", [])) or parts[0] == b"HTTP/1.0"
            chunked = any(b"chunked" in v for v in fields.get(b"transfer-encoding", []))
            length = fields.get(b"content-length")
            if method == b"HEAD" or status in (204, 304) or chunked or length:
                cwriter.write(head)
                if method == b"HEAD" or status in (204, 304):
                    pass
                elif chunked:
                    await self.copy_chunked(up.reader, cwriter)
                else:
                    await self.copy_exactly(up.reader, cwriter, int(length[-1]))
                await cwriter.drain()
                return not closing, not closing
            # No framing: the body ends when the router closes, so the client's connection ends with it.
            cwriter.write(head)
            while chunk := await up.reader.read(COPY_CHUNK):
                cwriter.write(chunk)
                await cwriter.drain()
            return False, False

    @staticmethod
    async def copy_exactly(reader, writer, n):
        while n:
            chunk = await reader.read(min(n, COPY_CHUNK))
            if not chunk:
                raise ConnectionError("the router closed mid-body")
            writer.write(chunk)
            n -= len(chunk)
            await writer.drain()

    async def copy_chunked(self, reader, writer):
        while True:
            line = await reader.readuntil(b"\r\n")
            writer.write(line)
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    t = await reader.readuntil(b"\r\n")
                    writer.write(t)
                    if t == b"\r\n":
                        return
            await self.copy_exactly(reader, writer, size + 2)


    # --- main -----------------------------------------------------------------------------------------------

    async def main(self):
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def on_hup():
            self.requested += 1
            self.reload_wanted.set()
            self.save()

        loop.add_signal_handler(signal.SIGHUP, on_hup)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        os.makedirs(os.path.dirname(os.path.abspath(self.args.state)), exist_ok=True)
        host, _, port = self.args.listen.rpartition(":")
        server = await asyncio.start_server(self.handle, host or None, int(port), limit=MAX_HEADER,
                                            reuse_address=True)
        self.save()
        log(f"listening on {self.args.listen}; {len(self.routers)} router(s) on ports "
            + ", ".join(str(r.port) for r in self.routers))
        tasks = [asyncio.ensure_future(self.run_router(r)) for r in self.routers]
        tasks.append(asyncio.ensure_future(self.reloader()))
        if self.args.watch:
            tasks.append(asyncio.ensure_future(self.watcher()))
        await done.wait()
        log("stopping: no new connections; routers finish their in-flight requests")
        self.stopping = True
        server.close()
        await asyncio.gather(*(self.stop_router(r) for r in self.routers))
        for t in tasks:
            t.cancel()
        self.save()


def reload(args):
    """Ask the running front for a rolling restart of its routers and wait for the outcome."""
    try:
        with open(args.state) as f:
            doc = json.load(f)
        pid = int(doc["pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError) as exc:
        print(json.dumps({"ok": False, "error": f"no running proxy front ({args.state}: {exc})"}))
        return 1
    # Every SIGHUP bumps `requested`; a reload counts for us once its sequence number is past what we saw.
    want = int(doc.get("requested", 0)) + 1
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        time.sleep(0.2)
        try:
            with open(args.state) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if int(doc.get("completed", 0)) >= want:
            last = doc["reload"]
            print(json.dumps({"ok": last["state"] == "done", "error": last["error"], "seconds": last["seconds"],
                              "routers": doc["routers"]}))
            return 0 if last["state"] == "done" else 1
    print(json.dumps({"ok": False, "error": f"the reload did not finish in {args.timeout:.0f}s"}))
    return 1


def router_ports(value):
    port, _, metrics = value.partition(":")
    if not (port.isdigit() and metrics.isdigit()):
        raise argparse.ArgumentTypeError("want PORT:METRICS_PORT")
    return int(port), int(metrics)


def parser():
    p = argparse.ArgumentParser(prog="proxy_front.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="serve (run under the supervisor); the router command follows --")
    run.add_argument("--listen", required=True, help="HOST:PORT of the public proxy port")
    run.add_argument("--router", type=router_ports, action="append", required=True,
                     help="PORT:METRICS_PORT of one router on loopback (repeat)")
    run.add_argument("--state", required=True, help="JSON file this front keeps its state in")
    run.add_argument("--api-key-file", help="clients must send this key (re-read when the file changes)")
    run.add_argument("--grace", type=float, default=60.0, help="SIGTERM to SIGKILL for a router")
    run.add_argument("--ready-timeout", type=float, default=600.0, help="a restarted router must answer by then")
    run.add_argument("--connect-wait", type=float, default=30.0,
                     help="how long a client waits for a router when none is up")
    run.add_argument("--watch", action="append", default=[],
                     help="URL listing prefill engine ids (JSON with engine_id fields) that the routers learn at their "
                          "start; restart them when the ids change (repeat)")
    run.add_argument("--watch-interval", type=float, default=3.0, help="seconds between --watch checks")
    rl = sub.add_parser("reload", help="restart the routers one at a time and wait")
    rl.add_argument("--state", required=True)
    rl.add_argument("--timeout", type=float, default=900.0)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cmd = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    args = parser().parse_args(argv)
    if args.command == "reload":
        return reload(args)
    if not cmd:
        parser().error("run needs the router command after --")
    asyncio.run(Front(args, cmd).main())
    return 0


if __name__ == "__main__":
    sys.exit(main())
