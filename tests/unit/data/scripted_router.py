"""A router copy behind the proxy front that fails on cue, for the front's retry tests. It takes the flags the front
gives it (the last --port wins, like argparse), answers GET /health 200, and answers every other request as its
target's query says: `?do=close,ok` makes the first request with that exact target that reaches any copy close the
connection unanswered and the second get 200 ("ok" past the list's end; the copies count in the journal they share,
SCRIPTED_ROUTER_JOURNAL, a JSON line per request: the copy's port, method, target, body length and sha256).

Actions: "ok" (200 JSON naming the copy's port), "close" (closes the connection without a byte), "reset" (a TCP
reset without a byte), "400", "502" (JSON error bodies), "500" (the text/plain "Internal Server Error" that
vllm-ascend's proxy answers when its prefill engine is gone), "503-chunked" and "504-unframed" (bodies chunked, and
ended by the close), "stream" (a whole SSE stream, chunked), "stream-cut" (the head and a first chunk, then the
connection closes); what vllm-ascend's proxy answers a non-streaming request when its decode engine dies: "empty" (a
200 JSON head at once, then an empty chunked body 0.3 s later; "empty-late": 2 s later), "cut-json" (a JSON object
cut short, in a whole chunked body); "empty-length" (200, Content-Length: 0); "big-N" (200, a JSON object of N bytes
in chunks of odd sizes, the sha256 of the body as sent, framing and all, in X-Body-Sha256), "big-N-cut" (the same,
closed before its last chunk)."""

import argparse
import fcntl
import hashlib
import json
import os
import socket
import struct
import sys
import threading
import time
import urllib.parse

ap = argparse.ArgumentParser()
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--port", type=int, default=30000)
args, _ = ap.parse_known_args()
JOURNAL = os.environ["SCRIPTED_ROUTER_JOURNAL"]


def journal(method, target, body):
    """Append this request to the journal; the action for it (the how-manieth request with this target)."""
    with open(JOURNAL, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        n = sum(1 for line in f if json.loads(line)["target"] == target)
        f.write(json.dumps({"port": args.port, "method": method, "target": target, "length": len(body),
                            "sha256": hashlib.sha256(body).hexdigest()}) + "\n")
    plan = urllib.parse.parse_qs(urllib.parse.urlsplit(target).query).get("do", [""])[-1].split(",")
    return plan[n] if n < len(plan) and plan[n] else "ok"


def answer(code, reason, body, ctype="application/json", extra=b""):
    return (f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n".encode() + extra
            + b"\r\n" + body)


def chunk(data):
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def reset(conn):
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def big(size, cut=False):
    """A 200 JSON answer of `size` body bytes, chunked in odd sizes (ended by the close when `cut`)."""
    doc = json.dumps({"port": args.port, "text": ""}).encode()
    body = doc[:-2] + (b"abcdefghijklmnopqrstuvwxyz" * (size // 26 + 1))[:size - len(doc)] + doc[-2:]
    sizes, framed, at = (65536, 1, 300_001, 7777), [], 0
    while at < len(body):
        n = sizes[len(framed) % len(sizes)]
        framed.append(chunk(body[at:at + n]))
        at += n
    raw = b"".join(framed) + (b"" if cut else b"0\r\n\r\n")
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
            + f"x-body-sha256: {hashlib.sha256(raw).hexdigest()}\r\n\r\n".encode() + raw)


def respond(conn, what):
    """Answer one request as the plan says; False when the connection is done."""
    error = json.dumps({"error": {"message": f"router {args.port}: {what}"}}).encode()
    sse = [f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode() for i in range(3)]
    if what == "close":
        conn.close()
    elif what == "reset":
        reset(conn)
    elif what == "stream-cut":
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + chunk(sse[0]))
        time.sleep(0.3)  # the front has relayed these; then the connection ends as a killed process's does
        conn.close()
    elif what == "stream":
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"".join(chunk(d) for d in sse) + b"0\r\n\r\n")
        return True
    elif what in ("empty", "empty-late", "cut-json"):  # uvicorn sends a StreamingResponse's head at once
        conn.sendall(b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-type: application/json\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        time.sleep(2.0 if what == "empty-late" else 0.3)  # the proxy tries its decode engine, then gives up
        conn.sendall((chunk(b'{"id":"cmpl-1","choices":[{"text":"Hel') if what == "cut-json" else b"") + b"0\r\n\r\n")
        return True
    elif what == "empty-length":
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n")
        return True
    elif what.startswith("big-"):
        conn.sendall(big(int(what.split("-")[1]), what.endswith("-cut")))
        if what.endswith("-cut"):
            conn.close()
            return False
        return True
    elif what == "503-chunked":
        conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(error)
                     + b"0\r\n\r\n")
        return True
    elif what == "504-unframed":
        conn.sendall(b"HTTP/1.1 504 Gateway Timeout\r\nConnection: close\r\n\r\n" + error)
        conn.close()
    elif what == "500":
        conn.sendall(answer(500, "Internal Server Error", b"Internal Server Error", "text/plain; charset=utf-8"))
        return True
    elif what in ("400", "502"):
        conn.sendall(answer(int(what), "Bad Request" if what == "400" else "Bad Gateway", error))
        return True
    else:
        conn.sendall(answer(200, "OK", json.dumps({"port": args.port}).encode()))
        return True
    return False


def serve(conn):
    buf = b""
    with conn:
        while True:
            while b"\r\n\r\n" not in buf:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            want = int(fields.get("content-length", "0"))
            while len(buf) < want:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            body, buf = buf[:want], buf[want:]
            if path == "/health":
                conn.sendall(answer(200, "OK", b'{"ok": true}'))
                continue
            if not respond(conn, journal(method, path, body)):
                return


lsock = socket.create_server((args.host, args.port), backlog=64)
while True:
    try:
        c, _ = lsock.accept()
    except KeyboardInterrupt:
        sys.exit(0)
    threading.Thread(target=serve, args=(c,), daemon=True).start()
