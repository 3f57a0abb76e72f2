#!/usr/bin/python3
"""Stdlib-only front of the P/D proxy, copied to hosts next to the supervisor.

It owns the proxy's public port and runs N copies of the router on loopback ports. Each client connection goes to
a router that is up (another one when a connect is refused). SIGHUP restarts the routers one at a time, each
gracefully (in-flight requests finish), so a router that cannot add workers at runtime (vllm-router in static P/D
mode) takes back drained workers while clients never see a refused connection.

Clients reach the client paths only (`/v1/*` and `/health`, or what --client-path lists); with --api-key-file
every request but `GET /health` must carry `Authorization: Bearer <key>` (vllm-router does not check client keys).
A router's own API (membership: drain, re-add) is reached only as `/kimictl/router/<i>/<path>` with the admin key
of --admin-key-file: the client key never opens it, and without an admin key file nothing does. With the same key,
`POST /kimictl/front/router/<i>/hold?seconds=N` keeps new client requests away from copy i (its clients' next
requests go to the other copies) for N seconds or until `.../release`: a router that re-adds an engine only while
idle (vllm-ascend's proxy) gets there without a restart. A hold may name its owner (`&owner=heal:123`): each owner's
hold lasts on its own, `.../release?owner=X` frees only X's, and a copy is held while anyone holds it; a release
without an owner frees every hold of the copy. The router kind's health path (--router-health) is what
the front checks its copies with and what the proxy port's `GET /health` asks.

Limits against abusive clients: a connection cap (a connection over it waits QUEUE_WAIT seconds for a slot, an idle
keep-alive connection giving up its own, then gets 503; with MAX_QUEUED waiting, new ones wait in the kernel's
backlog), at most --max-conns-per-client connections from one address (an IPv6 /64) that have not shown a key (a
valid client or admin key; on a front without --api-key-file, every connection counts), so a client without the key
cannot take every slot (more get 503), the request head within --header-timeout and the whole request, head and
body, within --request-timeout from its first byte, however it trickles (408), no body byte (or no response byte
taken) for --io-timeout ends the connection (408), keep-alive connections close after --idle-timeout, bodies over
--max-body get 413, chunked request bodies 411, log lines are rate-limited. The key is checked on the request head:
a request without it gets its 401 (403 on the admin paths) and its connection ends; its body is never read (what the
client sends on is dropped for LINGER seconds at most, so that the answer is not lost to a reset). The keyless
`GET /health` (open as vLLM's own --api-key leaves it, for load balancers and kimictl's probes) takes no body (400)
and is answered within --request-timeout (504). The client's credentials (Authorization, Proxy-Authorization,
X-Api-Key) never reach the routers: the front checks the keys, and the routers send the engines a key of their own
(vllm-ascend's proxy: OPENAI_API_KEY from its environment).
Bodies stream through to the router; one of up to RESEND_MAX bytes is kept until answered, so that a request whose
router failed before any byte of the answer went to the client is sent once more, to another copy when one is up (a
copy shutting down drops requests unanswered; an engine killed under a router fails its requests): a router that
closed the connection before a whole response head, or (client paths but the keyless GET /health) answered 500, 502,
503 or 504, whose answer is then dropped unsent. Only once (a second failure reaches the client), never after a byte
went out (a stream cut after its head fails as it is), never after a 4xx; a body too large to keep is not sent twice
(502, or the router's 5xx as is).
The same goes for an answer that looks whole but is not: a 2xx answer to a non-streaming generation request (POST
/v1/completions or /v1/chat/completions whose kept JSON body does not set "stream") is kept back until whole (at most
HOLD_MAX bytes, HOLD_BUDGET for all such answers at a time, and --request-timeout from its head; past these it goes
out as it came so far and the rest as it arrives), and an empty one, or a 200 JSON one that is not a JSON object (a
router closing mid-answer too), is dropped unsent and the request sent once more: vllm-ascend's proxy answers 200 at
once and ends the body empty when its decode engine dies before the first token. A kept answer goes out byte for byte
as the router sent it; a second empty one gets 502.
The state file counts these second attempts ("retries").
With --watch URL, routers that learn the prefill engines' ids once, at their start (vllm-router asks Mooncake
bootstrap servers), are restarted the same way when the engine ids those URLs list change (a prefill engine
restarted under a new id); the state file tells what the routers know meanwhile.
Runs on the hosts' python3: stdlib only, Python 3.9+.
"""

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import sys
import time
import urllib.parse
import urllib.request

ADMIN_RE = re.compile(rb"/kimictl/router/(\d{1,3})(/.*)?")
HOLD_RE = re.compile(rb"/kimictl/front/router/(\d{1,3})/(hold|release)")
HOLD_MAX = 3600.0  # seconds a hold lasts at most (a kimictl that died holding a copy cannot keep it out for long)
OWNER_RE = re.compile(r"[\x21-\x7e]{1,128}")  # a hold's owner: printable ASCII, no spaces (it is logged)
TOKEN_RE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
CTL_RE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # control characters but TAB: never in a request head line
DEFAULT_CLIENT_PATHS = ("/v1/*", "/health")
CREDENTIALS = (b"authorization", b"proxy-authorization", b"x-api-key")  # checked here, never forwarded
MAX_HEADER = 64 * 1024
COPY_CHUNK = 256 * 1024
RESEND_MAX = 1024 * 1024  # bodies up to this size are kept until answered, to send them again after a drop
RESEND_BUDGET = 64 * 1024 * 1024  # all bodies kept at one time; past it requests stream without a second chance
RETRY_STATUSES = (500, 502, 503, 504)  # a router's answers that send a kept body once more (the answer unsent)
FAILED_TEXT_MAX, FAILED_TEXT_WAIT = 300, 1.0  # bytes of such an answer's body read for the log line, and how long
GENERATION_PATHS = (b"/v1/completions", b"/v1/chat/completions")  # OpenAI generation: a whole answer is held
HOLD_MAX = 8 * 1024 * 1024  # bytes of a held answer (head and body as they came); past it the answer goes out
HOLD_BUDGET = 256 * 1024 * 1024  # bytes of all answers held at one time; past it an answer goes out as it comes
RETRY_SAVE_DELAY = 1.0  # the state file's retry count is written at most this late (not once a request)
QUEUE_WAIT = 2.0  # seconds a connection over the cap waits for a slot before its 503
MAX_QUEUED = 64  # connections waiting for a slot (or in the lingering close of their 503); more stay unaccepted
LINGER = 1.0  # seconds an answered, refused connection still takes (and drops) what its client sends
EVICT_IDLE_AFTER = 1.0  # at the cap, a keep-alive connection idle this long gives its slot to a waiting one
RESERVED_FDS = 64  # file descriptors kept for routers, health checks and the state file
LOG_BURST, LOG_WINDOW = 5, 10.0  # lines per kind of event and window (seconds); the rest are counted
BACKOFF_MAX = 30.0


def log(message):
    sys.stderr.write(f"proxy-front: {message}\n")
    sys.stderr.flush()


class RateLimitedLog:
    """At most LOG_BURST lines per kind of event in LOG_WINDOW seconds; the others are counted and the count is
    logged with the next line of that kind, so no client can flood the log."""

    def __init__(self):
        self.kinds = {}

    def __call__(self, kind, message):
        now = time.monotonic()
        start, shown, dropped = self.kinds.get(kind, (now, 0, 0))
        if now - start >= LOG_WINDOW:
            if dropped:
                log(f"({dropped} more '{kind}' line(s) left out in {LOG_WINDOW:.0f}s)")
            start, shown, dropped = now, 0, 0
        if shown < LOG_BURST:
            log(message[:500])
            shown += 1
        else:
            dropped += 1
        self.kinds[kind] = (start, shown, dropped)


warn = RateLimitedLog()


class AsyncioLogHandler(logging.Handler):
    """asyncio's own complaints (accept errors, writes to lost connections, destroyed tasks) through the rate
    limit, one line each without the traceback."""

    def emit(self, record):
        exc = record.exc_info[1] if record.exc_info else None
        warn(f"asyncio: {record.msg}"[:80], f"asyncio: {record.getMessage()}" + (f": {exc!r}" if exc else ""))


def write_json_atomic(path, doc):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def response(code, reason, text, extra=""):
    body = (json.dumps({"error": {"message": text, "code": code}}) + "\n").encode()
    return (f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}"
            "Connection: close\r\n\r\n").encode() + body


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
    """One HTTP/1.1 request head as the client sent it, checked strictly: what the front and the router behind it
    could read differently (bare CR or LF, obs-fold, odd Content-Length, Transfer-Encoding) is refused."""

    def __init__(self, raw):
        lines = raw.split(b"\r\n")
        if any(CTL_RE.search(line) for line in lines):
            raise HttpError(400, "Bad Request", "bare CR or LF, or a control character, in the request head")
        parts = lines[0].split(b" ")
        if (len(parts) != 3 or not TOKEN_RE.fullmatch(parts[0]) or not parts[1]
                or parts[2] not in (b"HTTP/1.0", b"HTTP/1.1")):
            raise HttpError(400, "Bad Request", "malformed request line")
        self.method, self.target, self.version = parts
        self.headers = lines[1:]
        self.fields = {}
        for line in self.headers:
            name, sep, value = line.partition(b":")
            if not sep or not TOKEN_RE.fullmatch(name):
                raise HttpError(400, "Bad Request", "malformed header line")
            self.fields.setdefault(name.lower(), []).append(value.strip(b" \t"))
        if self.fields.get(b"transfer-encoding"):
            raise HttpError(411, "Length Required", "chunked request bodies are not accepted; send Content-Length")
        lengths = set(self.fields.get(b"content-length", []))
        # isdigit and at most 18 digits: no sign, no list, and never int() of a 4300-digit number.
        if len(lengths) > 1 or any(not v.isdigit() or len(v) > 18 for v in lengths):
            raise HttpError(400, "Bad Request", "bad Content-Length")
        self.length = int(next(iter(lengths))) if lengths else 0
        self.keyed = False  # a valid client or admin key came with it (set by Front.command and Front.route)
        self.open_health = False  # the keyless GET /health (set by Front.route)
        self.generation = False  # a POST to an OpenAI generation path (GENERATION_PATHS; set by Front.route)
        tokens = b",".join(self.fields.get(b"connection", [])).lower()
        self.closing = b"close" in tokens or (self.version == b"HTTP/1.0" and b"keep-alive" not in tokens)
        # Answered here (before the body is read), so the router must not see it.
        self.expects_continue = any(v.lower() == b"100-continue" for v in self.fields.get(b"expect", []))
        # The client's credentials are the front's to check: the routers never see them.
        drop = CREDENTIALS + ((b"expect",) if self.expects_continue else ())
        self.headers = [h for h in self.headers if h.partition(b":")[0].lower() not in drop]

    def header(self, name):
        values = self.fields.get(name)
        return values[-1] if values else None

    def bearer(self):
        """The credential of `Authorization: Bearer <credential>` (the scheme in any case), or None."""
        scheme, _, credential = (self.header(b"authorization") or b"").partition(b" ")
        return credential.strip(b" \t") if scheme.lower() == b"bearer" else None

    def encode(self, target):
        return b"\r\n".join([b" ".join([self.method, target, self.version]), *self.headers]) + b"\r\n\r\n"


class KeyFile:
    """A key kept in a file, re-read when the file changes: a key rotates without a restart."""

    def __init__(self, path, what):
        self.path, self.what = path, what
        self.key, self.seen = None, None

    def matches(self, presented):
        if self.path is None or presented is None:
            return False
        try:
            st = os.stat(self.path)
            if (st.st_ino, st.st_size, st.st_mtime_ns) != self.seen:
                with open(self.path, "rb") as f:
                    self.key = f.read().strip()
                self.seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError as exc:
            warn(f"{self.what} file", f"cannot read the {self.what} file: {exc}")
            self.key, self.seen = None, None
        return bool(self.key) and hmac.compare_digest(presented, self.key)


class NothingSent(Exception):
    """The router failed before any byte of its response went to the client: it closed the connection (or stopped
    reading) before a whole response head, or answered a RETRY_STATUSES status that was kept back (the message
    says which)."""


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


class Client:
    """A client connection as the per-address cap sees it: its address, the key the cap counts it under (the
    address; an IPv6 one's /64, what one host usually has), and whether it is still counted (no key shown yet)."""

    def __init__(self, peer):
        self.peer, self.who, self.counted = peer, client_of(peer), False


def client_of(peer):
    try:
        ip = ipaddress.ip_address(peer.partition("%")[0])
    except ValueError:
        return peer
    if ip.version == 6 and ip.ipv4_mapped:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False)) if ip.version == 6 else str(ip)


class Session:
    """One client connection, served a request at a time. The upstream connection may change between requests (a
    router that shuts down closes it), so a router restart never reaches a client between two requests."""

    def __init__(self, front, reader, writer, client):
        self.front, self.args = front, front.args
        self.reader, self.writer, self.client, self.peer = reader, writer, client, client.peer
        self.up = None
        self.deadline = 0.0  # monotonic time by which the current request's head and body must have arrived
        self.replied = False  # a byte of the answer to the current request went to the client

    async def run(self):
        try:
            while True:
                req = await self.read_request()
                if req is None:
                    break
                self.replied = False
                reply = self.front.command(req)
                index, target = (None, None) if reply is not None else self.front.route(req)
                if req.keyed:  # a connection that showed a key no longer counts against its address
                    self.front.uncount(self.client)
                if reply is not None:  # the front's own admin command, answered here
                    await self.send(reply)
                    if req.closing:
                        break
                    continue
                if req.length > self.args.max_body:
                    raise HttpError(413, "Content Too Large", f"request body over {self.args.max_body} bytes")
                if req.expects_continue:
                    await self.send(b"HTTP/1.1 100 Continue\r\n\r\n")
                if req.open_health:
                    keep = await self.keyless_exchange(req, index, target)
                else:
                    keep = await self.exchange(req, index, target)
                if not keep or req.closing:
                    break
        except HttpError as exc:
            warn(f"client {exc.code}", f"client {self.peer}: {exc.code} {exc.text}")
            if not self.writer.is_closing():
                self.writer.write(response(exc.code, exc.reason, exc.text))
                with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
                    await asyncio.wait_for(self.writer.drain(), 5)
                    self.writer.write_eof()
                    await self.linger()
        except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass
        except Exception as exc:  # a bug costs this connection and one log line, never the front
            warn("internal error", f"client {self.peer}: internal error: {exc!r}")
        finally:
            self.close_up()
            self.writer.close()

    async def linger(self):
        """Read and drop what the client still sends for LINGER seconds (or until it closes) before closing: a close
        with unread data resets the connection, and the reset can destroy the answer before the client reads it."""
        deadline = time.monotonic() + LINGER
        with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
            while await asyncio.wait_for(self.reader.read(COPY_CHUNK), max(0.0, deadline - time.monotonic())):
                pass

    def close_up(self):
        if self.up:
            self.up.close()
            self.up = None

    async def send(self, data):
        """To the client; one that takes no byte for --io-timeout is dropped (asyncio.TimeoutError)."""
        self.replied = True
        self.writer.write(data)
        await asyncio.wait_for(self.writer.drain(), self.args.io_timeout)

    async def read_request(self):
        """The next request head; None when the client closed, or stayed idle between requests past --idle-timeout
        (or while the front needed its slot)."""
        self.front.idle[self] = time.monotonic()
        try:
            first = await asyncio.wait_for(self.reader.read(1), self.args.idle_timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self.front.idle.pop(self, None)
        if not first:
            return None
        self.deadline = time.monotonic() + self.args.request_timeout
        limit = min(self.args.header_timeout, self.args.request_timeout)
        try:
            rest = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), limit)
        except asyncio.TimeoutError:
            raise HttpError(408, "Request Timeout", f"the request head did not arrive within {limit:g}s") from None
        except asyncio.IncompleteReadError:
            raise HttpError(400, "Bad Request", "incomplete request") from None
        except asyncio.LimitOverrunError:
            raise HttpError(431, "Request Header Fields Too Large", "request head too large") from None
        return Request((first + rest)[:-4])

    async def read_some(self, n):
        """Up to n body bytes from the client, who must send one within --io-timeout, and the whole request by its
        deadline (--request-timeout)."""
        left = self.deadline - time.monotonic()
        try:
            if left <= 0:
                raise asyncio.TimeoutError()
            chunk = await asyncio.wait_for(self.reader.read(min(n, COPY_CHUNK)), min(left, self.args.io_timeout))
        except asyncio.TimeoutError:
            if left <= self.args.io_timeout:
                raise HttpError(408, "Request Timeout", "the request did not arrive whole within "
                                f"{self.args.request_timeout:g}s of its first byte") from None
            raise HttpError(408, "Request Timeout",
                            f"no byte of the request body for {self.args.io_timeout:g}s") from None
        if not chunk:
            raise ConnectionError("the client closed mid-body")
        return chunk

    async def exchange(self, req, index, target):
        """Send one request to a router and relay its answer; False when the client connection must end then."""
        head = req.encode(target)
        n = req.length
        if n <= RESEND_MAX and self.front.keep_body(n):
            try:
                parts = []
                while n:
                    parts.append(await self.read_some(n))
                    n -= len(parts[-1])
                return await self.forward(req, index, head, b"".join(parts))
            finally:
                self.front.kept -= req.length
        return await self.forward(req, index, head, None)

    async def keyless_exchange(self, req, index, target):
        """The keyless GET /health (no body), answered by the request's deadline or ended: 504 when nothing of
        the answer went out yet."""
        try:
            return await asyncio.wait_for(self.exchange(req, index, target),
                                          max(0.0, self.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            if self.replied:
                return False
            raise HttpError(504, "Gateway Timeout", "no answer to the keyless request within "
                            f"{self.args.request_timeout:g}s") from None

    async def forward(self, req, index, head, body):
        """body None: stream the client's body through (no second chance if the router drops the request). A kept
        body is sent once more when the first router failed before any byte of its answer went to the client (see
        NothingSent): to another copy when one is up (Front.connect), and never a third time."""
        failed = None  # (router, what it did) of the first attempt
        # The 2xx answer of a non-streaming generation request is held until whole (both attempts: a second empty
        # one gets 502 too); a body that is not JSON, or asks for a stream, is answered as it comes.
        hold = body is not None and index is None and req.generation and not_streaming(body)
        for attempt in (1, 2):
            up = await self.upstream(index, failed and failed[0])
            if failed:
                warn("retry", f"client {self.peer}: router {failed[0].index} {failed[1]} before any byte reached "
                              f"the client; {req.method.decode()} sent once more, to router {up.router.index}")
            whole = True
            try:
                up.writer.write(head)
                if body is None:
                    whole = await self.pump(up, req.length)
                else:
                    up.writer.write(body)
                    await self.upstream_drain(up)
                # The 5xx of a router is kept back when it can be retried: on a client path (the keyless health
                # check reports what the router says), with the body kept, on the first attempt.
                retry_5xx = body is not None and attempt == 1 and index is None and not req.open_health
                keep_up, keep_client = await self.relay_response(up, req.method, retry_5xx, hold)
            except NothingSent as exc:
                # A router shutting down closes idle connections and drops the ones still in its accept queue
                # without reading them, one whose engine died answers 5xx; nothing reached the client yet, so
                # send once more elsewhere.
                self.close_up()
                if body is None:
                    raise HttpError(502, "Bad Gateway", f"the router {exc} (a request with a body over "
                                    f"{RESEND_MAX} bytes is not sent twice)") from None
                if attempt == 2:
                    raise HttpError(502, "Bad Gateway", f"router {failed[0].index} {failed[1]}, then router "
                                    f"{up.router.index} {exc}") from None
                failed = (up.router, str(exc))
                self.front.count_retry()
                continue
            if not (keep_up and whole):
                self.close_up()
            return keep_client and whole
        return False  # not reached: the second attempt returns or raises

    async def upstream(self, index, avoid=None):
        held = index is None and self.up is not None and self.up.router.held()
        if self.up and (self.up.index != index or self.up.reader.at_eof() or held):
            self.close_up()
        if self.up is None:
            self.up = Upstream(index, *await self.front.connect(index, avoid))
        return self.up

    async def upstream_drain(self, up):
        try:
            await asyncio.wait_for(up.writer.drain(), self.args.io_timeout)
        except (ConnectionError, OSError, asyncio.TimeoutError):
            raise NothingSent("stopped taking the request") from None

    async def pump(self, up, n):
        """Stream n body bytes from the client to the router; False when the router stopped taking them (its
        answer, if it sent one, still reaches the client, whose connection then ends)."""
        while n:
            chunk = await self.read_some(n)
            n -= len(chunk)
            up.writer.write(chunk)
            try:
                await self.upstream_drain(up)
            except NothingSent:
                return False
        return True

    async def relay_response(self, up, method, retry_5xx=False, hold=False):
        """Copy one response (after any 1xx) to the client as it arrives; (keep upstream, keep client). retry_5xx: a
        RETRY_STATUSES answer (before any 1xx went out) is not sent: NothingSent, with the start of its body. hold: a
        2xx answer but 204 (none went out before it) is held until whole (see Relay): NothingSent when its body is
        empty, or it is a 200 JSON one that is not a JSON object, or the router closed before its end."""
        while True:
            try:
                head = await up.reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                raise NothingSent("closed the connection before a whole response head") from exc
            except asyncio.LimitOverrunError:
                raise HttpError(502, "Bad Gateway", "the router's response head is too large") from None
            lines = head[:-4].split(b"\r\n")
            parts = lines[0].split(b" ", 2)
            if len(parts) < 2 or not parts[1].isdigit() or len(parts[1]) != 3:
                raise HttpError(502, "Bad Gateway", "malformed response from the router")
            status = int(parts[1])
            fields = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                fields.setdefault(name.strip().lower(), []).append(value.strip().lower())
            if 100 <= status < 200:
                if status == 101:
                    raise HttpError(502, "Bad Gateway", "protocol upgrades are not proxied")
                retry_5xx = hold = False  # a byte went to the client
                await self.send(head)
                continue
            closing = any(b"close" in v for v in fields.get(b"connection", [])) or parts[0] == b"HTTP/1.0"
            chunked = any(b"chunked" in v for v in fields.get(b"transfer-encoding", []))
            length = fields.get(b"content-length")
            if length and not (length[-1].isdigit() and len(length[-1]) <= 18):
                raise HttpError(502, "Bad Gateway", "bad Content-Length from the router")
            if retry_5xx and status in RETRY_STATUSES:
                text = "" if method == b"HEAD" else await failed_text(up.reader, chunked, length)
                raise NothingSent(f"answered {status}" + (f" ({text})" if text else ""))
            hold = (hold and 200 <= status < 300 and status != 204 and method != b"HEAD"
                    and not (length and not chunked and int(length[-1]) > HOLD_MAX))
            out = Relay(self, hold)
            try:
                framed = await self.relay_body(up.reader, out, head, method, status, chunked, length)
                if out.holding:
                    why = failed_whole(status, fields, b"".join(out.body))
                    if why:
                        raise NothingSent(why)
                    await out.release()
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as exc:
                if out.holding:  # nothing went out: the router failed before any byte reached the client
                    raise NothingSent(f"answered {status}, then closed the connection before the answer's end "
                                      f"({str(exc) or type(exc).__name__})") from exc
                raise
            finally:
                out.drop()
            return framed and not closing, framed and not closing

    async def relay_body(self, reader, out, head, method, status, chunked, length):
        """The head and body of one answer through `out`; False when the body ended with the connection (no
        framing: the client's connection ends with it)."""
        await out.put(head)
        if method == b"HEAD" or status in (204, 304):
            return True
        if chunked:
            await self.copy_chunked(reader, out)
        elif length:
            await self.copy_exactly(reader, int(length[-1]), out)
        else:
            while True:
                chunk = await out.read(reader.read, COPY_CHUNK)
                if not chunk:
                    return False
                await out.put(chunk, chunk)
        return True

    async def copy_exactly(self, reader, n, out, data=None):
        """n bytes of the answer through `out`, the first `data` of them (all when None) its body."""
        data = n if data is None else data
        while n:
            chunk = await out.read(reader.read, min(n, COPY_CHUNK))
            if not chunk:
                raise ConnectionError("the router closed mid-body")
            n -= len(chunk)
            await out.put(chunk, chunk[:data])
            data = max(0, data - len(chunk))

    async def copy_chunked(self, reader, out):
        while True:
            line = await out.read(reader.readuntil, b"\r\n")
            await out.put(line)
            try:
                size = int(line.split(b";")[0].strip()[:16], 16)
            except ValueError:
                raise ConnectionError("bad chunk size from the router") from None
            if size == 0:
                break
            await self.copy_exactly(reader, size + 2, out, size)
        while True:  # trailers, then the empty line
            t = await out.read(reader.readuntil, b"\r\n")
            await out.put(t)
            if t == b"\r\n":
                return


class Relay:
    """Where a router's answer goes: to the client as it arrives, or (held) kept back, head and body as they came,
    until it is whole, so that a failed one is sent to no client (Session.relay_response). A held answer is released,
    what came so far sent and the rest relayed as it arrives, once it passes HOLD_MAX bytes, or all held answers
    HOLD_BUDGET, or --request-timeout after its head."""

    def __init__(self, session, hold):
        self.session, self.front, self.holding = session, session.front, hold
        self.until = time.monotonic() + session.args.request_timeout
        self.raw, self.body, self.size = [], [], 0  # held: the bytes as they came, the body's (no framing), bytes

    async def read(self, call, *args):
        """call(*args): a StreamReader read, which a timeout cancels without losing data; while held, one that has
        not returned by the deadline releases the answer (and is made again)."""
        if self.holding:
            try:
                return await asyncio.wait_for(call(*args), max(0.0, self.until - time.monotonic()))
            except asyncio.TimeoutError:
                await self.release()
        return await call(*args)

    async def put(self, raw, data=b""):
        """raw: bytes of the answer as they came; data: what of them is its body (none of the chunked framing)."""
        if not self.holding:
            await self.session.send(raw)
            return
        self.raw.append(raw)
        if data:
            self.body.append(data)
        self.size += len(raw)
        self.front.held_bytes += len(raw)
        if self.size > HOLD_MAX or self.front.held_bytes > HOLD_BUDGET:
            await self.release()

    async def release(self):
        raw = b"".join(self.raw)
        self.drop()
        await self.session.send(raw)

    def drop(self):
        if self.holding:
            self.holding = False
            self.front.held_bytes -= self.size
            self.raw, self.body, self.size = [], [], 0


def not_streaming(body):
    """True when a generation request's body is a JSON object that does not ask for a stream ("stream" absent, null
    or false); False when it does, and when the body is no JSON object (unknown: the answer is relayed as it comes)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("stream") in (None, False)


def failed_whole(status, fields, body):
    """Why a whole 2xx answer to a non-streaming generation request is its router's failure (its de-chunked body
    empty, or a 200 JSON one not a JSON object: cut short), for NothingSent; None when it is not."""
    if not body:
        return f"answered {status} with an empty body"
    ctype = (fields.get(b"content-type") or [b""])[-1].split(b";")[0].strip()
    if status != 200 or not (ctype == b"application/json" or ctype.endswith(b"+json")):
        return None
    try:
        if isinstance(json.loads(body), dict):
            return None
    except (ValueError, RecursionError):
        pass
    return f"answered 200 with a body that is not a JSON object ({one_line(body[:FAILED_TEXT_MAX])})"


def one_line(data):
    return " ".join(data.decode(errors="replace").split())


async def failed_text(reader, chunked, length):
    """The start of the body of a router's 5xx answer that is not sent, for the log line of its retry: at most
    FAILED_TEXT_MAX bytes (of the first chunk when chunked), what came within FAILED_TEXT_WAIT; the rest is never
    read (the connection is closed)."""

    async def start():
        n = FAILED_TEXT_MAX
        if chunked:
            n = min(n, int((await reader.readuntil(b"\r\n")).split(b";")[0].strip()[:16], 16))
        elif length:
            n = min(n, int(length[-1]))
        return await reader.read(n) if n else b""

    try:
        data = await asyncio.wait_for(start(), FAILED_TEXT_WAIT)
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
            ValueError):
        return ""
    return one_line(data)


class Router:
    def __init__(self, index, port, metrics_port, argv, metrics_flag="--prometheus-port"):
        self.index, self.port, self.metrics_port = index, port, metrics_port
        # argparse takes the last of a repeated flag: these override whatever the rendered command says.
        self.argv = [*argv, "--host", "127.0.0.1", "--port", str(port)]
        if metrics_flag:  # a router kind without a metrics port gets none
            self.argv += [metrics_flag, str(metrics_port)]
        self.proc = None
        self.state = "stopped"
        self.accepting = False
        self.restarts = 0
        self.active = 0
        self.holds = {}  # owner ("" for a hold without one) -> monotonic time until which it holds this copy
        self.started_at = None
        self.exited = asyncio.Event()
        self.ready = asyncio.Event()
        self.restart_now = asyncio.Event()

    def doc(self):
        return {"index": self.index, "port": self.port, "metrics_port": self.metrics_port, "state": self.state,
                "pid": self.proc.pid if self.proc and self.proc.returncode is None else None,
                "restarts": self.restarts, "active": self.active, "started_at": self.started_at,
                "held": self.held(), "holders": self.holders()}

    def holders(self):
        """The owners whose hold of this copy has not ended (no new client request goes here meanwhile)."""
        now = time.monotonic()
        for owner in [o for o, until in self.holds.items() if until <= now]:
            del self.holds[owner]
        return sorted(self.holds)

    def held(self):
        return bool(self.holders())


class Front:
    def __init__(self, args, argv):
        # Built inside the running loop (see serve): on Python 3.9 an asyncio.Event binds the loop that is current
        # when it is made, and one made before asyncio.run would never wake a task of the loop that run makes.
        self.args = args
        metrics_flag = None if args.no_router_metrics else "--prometheus-port"
        self.routers = [Router(i, p, m, argv, metrics_flag) for i, (p, m) in enumerate(args.router)]
        self.health = args.router_health.encode()  # the router kind's own health path
        self.rr = 0
        self.stopping = False
        self.requested = 0  # SIGHUPs seen
        self.completed = 0  # reloads finished (done or failed), by sequence number
        self.last = {"seq": 0, "state": "idle", "error": None, "seconds": None}
        self.reload_wanted = asyncio.Event()
        self.client_key = KeyFile(args.api_key_file, "API key") if args.api_key_file else None
        self.admin_key = KeyFile(args.admin_key_file, "admin key")
        self.client_paths = [(p[:-1].encode(), True) if p.endswith("*") else (p.encode(), False)
                             for p in (args.client_path or DEFAULT_CLIENT_PATHS)]
        self.cap = connection_cap(args.max_connections)
        self.active = 0  # client connections being served
        self.queued = 0  # client connections waiting for a slot (or in the lingering close of their 503)
        self.untrusted = {}  # client address (Client.who) -> its connections that have shown no key yet
        self.freed = asyncio.Event()  # set (and replaced) whenever a slot or a place in the queue frees
        self.idle = {}  # session -> since when it waits for its next request (oldest first)
        self.kept = 0  # bytes of request bodies kept for a second attempt
        self.held_bytes = 0  # bytes of answers held until whole (see Relay)
        self.retries = 0  # requests sent a second time (see Session.forward)
        self.save_due = False  # a save of the retry count is scheduled
        self.tasks = set()
        # --watch: the engine ids the URLs list now, and the ones every router learnt at its last (re)start
        self.watch = {"urls": list(args.watch), "engine_ids": None, "routers_know": None, "checked_at": None,
                      "changed_at": None}

    # --- state file -----------------------------------------------------------------------------------------

    def save(self):
        self.save_due = False
        write_json_atomic(self.args.state, {
            "pid": os.getpid(), "listen": self.args.listen, "requested": self.requested, "completed": self.completed,
            "reload": self.last, "routers": [r.doc() for r in self.routers],
            "api_key": self.args.api_key_file is not None, "admin_key": self.args.admin_key_file is not None,
            "max_connections": self.cap, "watch": self.watch if self.args.watch else None, "retries": self.retries,
        })

    def count_retry(self):
        """One more request sent a second time; the state file has it within RETRY_SAVE_DELAY."""
        self.retries += 1
        if not self.save_due:
            self.save_due = True
            asyncio.get_running_loop().call_later(RETRY_SAVE_DELAY, self.save_retries)

    def save_retries(self):
        if self.save_due:
            try:
                self.save()
            except OSError as exc:
                warn("state file", f"cannot write the state file: {exc}")

    # --- routers --------------------------------------------------------------------------------------------

    async def healthy(self, r):
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", r.port), 2)
        except (OSError, asyncio.TimeoutError):
            return False
        try:
            writer.write(b"GET " + self.health + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
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

    def command(self, req):
        """The answer to one of the front's own admin commands (hold or release a router copy), or None."""
        path, _q, query = req.target.partition(b"?")
        m = HOLD_RE.fullmatch(path)
        if not m:
            return None
        if not self.admin_key.matches(req.bearer()):
            raise HttpError(403, "Forbidden", "router admin paths need the admin key")
        req.keyed = True
        if req.method != b"POST" or req.length:
            raise HttpError(405, "Method Not Allowed", "POST, without a body")
        index, verb = int(m.group(1)), m.group(2)
        if index >= len(self.routers):
            raise HttpError(404, "Not Found", f"no router {index}")
        r = self.routers[index]
        params = urllib.parse.parse_qs(query.decode(errors="replace"))
        owner = params.get("owner", [None])[-1]
        if owner is not None and not OWNER_RE.fullmatch(owner):
            raise HttpError(400, "Bad Request", "owner must be 1-128 printable characters without spaces")
        if verb == b"hold":
            try:
                seconds = float(params.get("seconds", ["300"])[-1])
            except ValueError:
                raise HttpError(400, "Bad Request", "seconds must be a number") from None
            others = [o for o in self.routers if o is not r and o.accepting and not o.held()]
            if len(self.routers) > 1 and not others:
                raise HttpError(409, "Conflict", f"router {index} not held: no other router is up to take its "
                                                 "clients")
            r.holds[owner or ""] = time.monotonic() + max(0.0, min(seconds, HOLD_MAX))
        elif owner is None:
            r.holds.clear()
        else:
            r.holds.pop(owner, None)
        who = f" by {owner}" if owner else ""
        log(f"router {index}: {'hold' if verb == b'hold' else 'release'}{who}; "
            f"{'held by ' + (', '.join(o or '(no owner)' for o in r.holders())) if r.held() else 'released'}")
        self.save()
        body = (json.dumps({"router": index, "held": r.held(), "active": r.active}) + "\n").encode()
        return (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                .encode() + body)

    def route(self, req):
        """(router index, target to send) for the admin channel, (None, target) for a client path; HttpError for
        anything else. The path is judged as a router would read it, percent-escapes decoded."""
        path, q, query = req.target.partition(b"?")
        if not path.startswith(b"/"):
            raise HttpError(400, "Bad Request", "the request target must be a path")
        plain = urllib.parse.unquote_to_bytes(path)
        if b"\\" in plain or CTL_RE.search(plain) or any(s in (b".", b"..") for s in plain.split(b"/")):
            raise HttpError(400, "Bad Request", "dot segments, backslashes or control characters in the path")
        m = ADMIN_RE.fullmatch(path)
        if m:
            if not self.admin_key.matches(req.bearer()):
                raise HttpError(403, "Forbidden", "router admin paths need the admin key")
            req.keyed = True
            return int(m.group(1)), (m.group(2) or b"/") + q + query
        if not any(plain.startswith(p) if prefix else plain == p for p, prefix in self.client_paths):
            raise HttpError(404, "Not Found", "not a client path of this proxy ("
                            + ", ".join(p.decode() + ("*" if prefix else "") for p, prefix in self.client_paths) + ")")
        open_health = req.method in (b"GET", b"HEAD") and plain == b"/health"  # as vLLM's own --api-key leaves it
        if open_health:
            if req.length:  # no body byte is read for a request that needs no key
                raise HttpError(400, "Bad Request", "GET /health takes no body")
            req.open_health = True
            # the proxy port's /health asks the router's own health check
            return None, (req.target if self.health == b"/health" else self.health)
        if self.client_key:
            if not self.client_key.matches(req.bearer()):
                raise HttpError(401, "Unauthorized", "missing or wrong API key (Authorization: Bearer ...)")
            req.keyed = True
        req.generation = req.method == b"POST" and plain in GENERATION_PATHS
        return None, req.target

    def keep_body(self, n):
        """Reserve room to keep an n-byte body for a second attempt; False when the budget is spent."""
        if self.kept + n > RESEND_BUDGET:
            return False
        self.kept += n
        return True

    async def connect(self, index, avoid=None):
        """Connect to router `index`, or to any accepting router (round robin, failing over; router `avoid` only
        when no other one takes the connection), waiting a while when none is up (all restarting) instead of
        refusing the client."""
        deadline = time.monotonic() + self.args.connect_wait
        while not self.stopping:
            if index is not None:
                order = [self.routers[index]] if index < len(self.routers) else []
            else:
                self.rr += 1
                order = [r for r in self.routers[self.rr % len(self.routers):] + self.routers[:self.rr %
                         len(self.routers)] if r.accepting and not r.held()]
                order.sort(key=lambda r: r is avoid)  # stable: the round robin's order otherwise
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

    async def accept_loop(self, lsock):
        """Accept one connection at a time. With a slot free and a place for its address (fewer than
        --max-conns-per-client of its connections have shown no key), it is served; else it waits for both
        (QUEUE_WAIT, an idle keep-alive connection giving up its own), then is served or gets 503. With
        MAX_QUEUED waiting, nothing is accepted while the slots are full (new connections wait in the kernel's
        backlog), and a connection with no place for its address gets its 503 at once. File descriptors stay
        bounded however many connections arrive."""
        loop = asyncio.get_running_loop()
        while True:
            while self.active >= self.cap and self.queued >= MAX_QUEUED:
                await self.freed.wait()
            try:
                sock, addr = await loop.sock_accept(lsock)
            except OSError as exc:  # out of file descriptors, mostly: wait a little instead of spinning
                warn("accept", f"cannot accept a connection: {exc}")
                await asyncio.sleep(0.5)
                continue
            client = Client(addr[0] if isinstance(addr, tuple) else str(addr))
            if self.admit(client):
                self.spawn(self.serve(sock, client))
            elif self.queued < MAX_QUEUED:
                self.queued += 1
                self.spawn(self.wait_for_slot(sock, client))
            else:  # the slots are not full: the queue is, with connections of addresses at their cap
                text = self.refusal(client)
                with contextlib.suppress(OSError):  # no lingering close: read what came, so that no reset
                    sock.send(response(503, "Service Unavailable", text, "Retry-After: 1\r\n"))
                    sock.shutdown(socket.SHUT_WR)
                    while sock.recv(COPY_CHUNK):
                        pass
                sock.close()

    def admit(self, client):
        """Take a slot, and a place for the client's address, when both are free."""
        if self.active >= self.cap or self.untrusted.get(client.who, 0) >= self.args.max_conns_per_client:
            return False
        self.active += 1
        self.untrusted[client.who] = self.untrusted.get(client.who, 0) + 1
        client.counted = True
        return True

    def uncount(self, client):
        """The connection no longer counts against its address: it showed a key, or it is gone."""
        if client.counted:
            client.counted = False
            left = self.untrusted[client.who] - 1
            if left:
                self.untrusted[client.who] = left
            else:
                del self.untrusted[client.who]
            self.notify()

    def refusal(self, client):
        """The 503's text for a connection that got no slot, or no place for its address (logged)."""
        if self.active >= self.cap:
            warn("connection cap", f"client {client.peer}: 503, the front serves {self.active} connections (its cap)")
            return f"the proxy is at its connection limit ({self.cap}); retry"
        warn("client cap", f"client {client.peer}: 503, {self.args.max_conns_per_client} connections from "
                           f"{client.who} have shown no key")
        return (f"too many connections from {client.who} that have shown no API key "
                f"({self.args.max_conns_per_client}); retry")

    def spawn(self, coro):
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def notify(self):
        """A slot or a place in the queue is free: wake whoever waits for one."""
        self.freed.set()
        self.freed = asyncio.Event()

    def evict_idle(self, who=None):
        """The connection idle longest between two requests (who: of those from that address that have shown no
        key), when idle EVICT_IDLE_AFTER or more, is closed (a keep-alive connection may be closed at any time;
        its client opens a new one)."""
        found = next(((s, t) for s, t in self.idle.items()
                      if who is None or (s.client.who == who and s.client.counted)), None)
        if found:
            session, since = found
            if time.monotonic() - since >= EVICT_IDLE_AFTER:
                del self.idle[session]
                self.uncount(session.client)
                session.writer.close()

    async def wait_for_slot(self, sock, client):
        """A connection with no slot or no place for its address (counted in self.queued until served or
        refused)."""
        admitted = False
        try:
            deadline = time.monotonic() + QUEUE_WAIT
            while not (admitted := self.admit(client)) and time.monotonic() < deadline:
                self.evict_idle(None if self.active >= self.cap else client.who)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.freed.wait(), min(0.2, max(0.0, deadline - time.monotonic())))
            if not admitted:
                await self.refuse(sock, self.refusal(client))
        finally:
            self.queued -= 1
            self.notify()
        if admitted:
            await self.serve(sock, client)

    async def refuse(self, sock, text):
        """503, then a lingering close (see Session.linger)."""
        loop = asyncio.get_running_loop()
        try:
            sock.send(response(503, "Service Unavailable", text, "Retry-After: 1\r\n"))
            sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + LINGER
            while await asyncio.wait_for(loop.sock_recv(sock, COPY_CHUNK), max(0.0, deadline - time.monotonic())):
                pass
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            sock.close()

    async def serve(self, sock, client):
        """Serve one accepted connection (its slot already counted in self.active)."""
        try:
            try:
                reader, writer = await asyncio.open_connection(sock=sock, limit=MAX_HEADER)
            except OSError:
                sock.close()
                return
            await Session(self, reader, writer, client).run()
        finally:
            self.uncount(client)
            self.active -= 1
            self.notify()

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
        lsock = listen_socket(self.args.listen)
        if self.cap < self.args.max_connections:
            log(f"connection cap lowered from {self.args.max_connections} to {self.cap}: the open-file limit is "
                "too low for more")
        self.save()
        log(f"listening on {self.args.listen}; {len(self.routers)} router(s) on ports "
            + ", ".join(str(r.port) for r in self.routers) + f"; at most {self.cap} client connections")
        tasks = [asyncio.ensure_future(self.run_router(r)) for r in self.routers]
        tasks.append(asyncio.ensure_future(self.reloader()))
        if self.args.watch:
            tasks.append(asyncio.ensure_future(self.watcher()))
        accept = asyncio.ensure_future(self.accept_loop(lsock))
        await done.wait()
        log("stopping: no new connections; routers finish their in-flight requests")
        self.stopping = True
        accept.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await accept
        lsock.close()
        await asyncio.gather(*(self.stop_router(r) for r in self.routers))
        for t in tasks:
            t.cancel()
        self.save()


def listen_socket(listen):
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    sock = socket.create_server((host, int(port)), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                backlog=1024)
    sock.setblocking(False)
    return sock


def connection_cap(want):
    """--max-connections, lowered to what the open-file limit allows after raising its soft limit as far as the
    hard one lets it (under systemd the soft limit is 1024): two descriptors a connection (client, router), the
    waiting ones and RESERVED_FDS."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * want + MAX_QUEUED + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft == resource.RLIM_INFINITY:
        return want
    return max(1, min(want, (soft - MAX_QUEUED - RESERVED_FDS) // 2))


async def serve(args, cmd):
    await Front(args, cmd).main()


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


def positive(kind):
    def check(value):
        try:
            v = kind(value)
        except ValueError:
            v = 0
        if v <= 0:
            raise argparse.ArgumentTypeError(f"want a positive number, not {value!r}")
        return v
    return check


def client_path(value):
    if not value.startswith("/"):
        raise argparse.ArgumentTypeError("want a path (/v1/*, /health)")
    return value


def parser():
    p = argparse.ArgumentParser(prog="proxy_front.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="serve (run under the supervisor); the router command follows --")
    run.add_argument("--listen", required=True, help="HOST:PORT of the public proxy port")
    run.add_argument("--router", type=router_ports, action="append", required=True,
                     help="PORT:METRICS_PORT of one router on loopback (repeat)")
    run.add_argument("--state", required=True, help="JSON file this front keeps its state in")
    run.add_argument("--api-key-file", help="clients must send this key (re-read when the file changes)")
    run.add_argument("--router-health", default="/health",
                     help="the routers' health path: the front's checks of its copies, and what /health asks")
    run.add_argument("--no-router-metrics", action="store_true",
                     help="the router has no metrics port (no --prometheus-port is passed)")
    run.add_argument("--admin-key-file", help="the routers' own API (/kimictl/router/<i>/...) needs this key "
                     "(re-read when the file changes); without it that API is closed")
    run.add_argument("--client-path", type=client_path, action="append",
                     help="a path clients may reach, PREFIX* for a prefix (repeat; default /v1/* and /health)")
    run.add_argument("--max-connections", type=positive(int), default=1024,
                     help="client connections served at once (lowered to what the open-file limit allows)")
    run.add_argument("--max-body", type=positive(int), default=256 * 2**20, help="request body limit in bytes (413)")
    run.add_argument("--header-timeout", type=positive(float), default=10.0,
                     help="seconds for a request head, from its first byte (408)")
    run.add_argument("--request-timeout", type=positive(float), default=120.0,
                     help="seconds for a whole request, head and body, from its first byte, however it trickles "
                          "(408); a keyless GET /health is answered within it too (504)")
    run.add_argument("--max-conns-per-client", type=positive(int), default=64,
                     help="connections from one client address (an IPv6 /64) that have not shown a valid key (on a "
                          "front without --api-key-file: every connection); more get 503")
    run.add_argument("--io-timeout", type=positive(float), default=30.0,
                     help="seconds without a byte of a request body (408), or without the client taking a byte of "
                          "its response (dropped)")
    run.add_argument("--idle-timeout", type=positive(float), default=75.0,
                     help="seconds a keep-alive connection may wait for its next request")
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
    handler = AsyncioLogHandler()
    logging.getLogger("asyncio").addHandler(handler)
    logging.getLogger("asyncio").propagate = False
    asyncio.run(serve(args, cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
