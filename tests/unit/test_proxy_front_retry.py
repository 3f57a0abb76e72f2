"""The proxy front sends a request once more, to another router copy when one is up, when its router failed before
any byte of the answer went to the client (closed or reset before a response head, or answered 500/502/503/504, or,
to a non-streaming generation request, answered 2xx with an empty body or 200 with one that is not a JSON object);
never a 4xx, never a stream that started, never a body too large to keep, never a third time. The router copies are
tests/unit/data/scripted_router.py: each request's target says how the copies answer it."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
from pathlib import Path

from test_proxy_front import ADMIN, KEY, Front

ROUTER = Path(__file__).parent / "data" / "scripted_router.py"
RESEND_MAX = 1024 * 1024  # proxy_front.RESEND_MAX: larger bodies are not kept


def scripted(tmp: Path, routers: int = 2, extra: tuple[str, ...] = ()) -> tuple[Front, Path]:
    journal = tmp / "journal"
    journal.write_text("")
    return Front(tmp, routers=routers, router=ROUTER, env={"SCRIPTED_ROUTER_JOURNAL": str(journal)},
                 extra=list(extra)), journal


def ask(f: Front, target: str, body: bytes = b"{}", key: str = KEY) -> tuple[int, bytes, bytes]:
    """(status, head, body as it came) of one request on its own connection."""
    head = (f"POST {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    got = f.raw(head + body)
    top, _, rest = got.partition(b"\r\n\r\n")
    return int(top.split(b" ")[1]), top, rest


def attempts(journal: Path, target: str) -> list[dict]:
    return [d for d in map(json.loads, journal.read_text().splitlines()) if d["target"] == target]


def ports(f: Front) -> list[int]:
    return [r["port"] for r in f.doc()["routers"]]


def test_a_router_failure_before_any_answer_byte_is_sent_once_more_to_the_other_copy(tmp_path: Path) -> None:
    f, journal = scripted(tmp_path)
    try:
        body = os.urandom(200_000)  # any bytes: the front relays them, and keeps them for a second attempt
        failures = ["close", "reset", "502", "500", "503-chunked", "504-unframed"]
        for n, first in enumerate(failures, 1):
            target = f"/v1/completions?do={first},ok"
            code, _, answer = ask(f, target, body)
            tries = attempts(journal, target)
            assert code == 200, (first, answer)
            assert len(tries) == 2 and tries[0]["port"] != tries[1]["port"], (first, tries)
            assert json.loads(answer) == {"port": tries[1]["port"]}  # the second copy's answer, only it
            assert all(t["length"] == len(body) and t["sha256"] == hashlib.sha256(body).hexdigest() for t in tries)
            f.wait(lambda d, n=n: d["retries"] == n, timeout=30)
        log = f.log_path.read_text()
        for text in ("closed the connection before a whole response head", "answered 502 ({\"error\":",
                     "answered 500 (Internal Server Error)"):
            assert re.search(r"router \d " + re.escape(text) + r".* sent once more, to router \d", log), text

        # Both copies fail: one error, after exactly two attempts (the first copy's failure named in it).
        target = "/v1/completions?do=close,reset"
        code, top, answer = ask(f, target, body)
        tries = attempts(journal, target)
        assert code == 502 and len(tries) == 2 and tries[0]["port"] != tries[1]["port"]
        error = json.loads(answer)["error"]
        assert error["code"] == 502 and "closed the connection before a whole response head" in error["message"]
        # ... and when the second one answers 5xx, the client gets that answer as it is.
        target = "/v1/completions?do=502,503-chunked"
        code, top, answer = ask(f, target, body)
        assert code == 503 and b"chunked" in top.lower() and b"503-chunked" in answer
        assert len(attempts(journal, target)) == 2
        f.wait(lambda d: d["retries"] == len(failures) + 2, timeout=30)
    finally:
        assert f.stop() == 0


def test_what_is_not_sent_again(tmp_path: Path) -> None:
    f, journal = scripted(tmp_path)
    try:
        # A 4xx is the client's to fix: relayed once.
        code, _, answer = ask(f, "/v1/completions?do=400")
        assert code == 400 and b"router" in answer and len(attempts(journal, "/v1/completions?do=400")) == 1
        # A stream cut after its head and first chunk: the client sees it cut (no last chunk), nothing is resent.
        code, _, answer = ask(f, "/v1/completions?do=stream-cut", b'{"stream": true}')
        assert code == 200 and b'"text": "0"' in answer and not answer.endswith(b"0\r\n\r\n")
        assert len(attempts(journal, "/v1/completions?do=stream-cut")) == 1
        # A body too large to keep streams through: the router's 5xx reaches the client as it is.
        big = b"x" * (RESEND_MAX + 1)
        code, _, answer = ask(f, "/v1/completions?do=502", big)
        tries = attempts(journal, "/v1/completions?do=502")
        assert code == 502 and b"router" in answer and len(tries) == 1 and tries[0]["length"] == len(big)
        # ... and one it closed on unanswered gets the front's 502 (as before).
        code, _, answer = ask(f, "/v1/completions?do=close", big)
        assert code == 502 and "not sent twice" in json.loads(answer)["error"]["message"]
        assert len(attempts(journal, "/v1/completions?do=close")) == 1
        # The routers' own API (admin channel): a 5xx of the copy it names is that copy's answer.
        code, _, answer = ask(f, "/kimictl/router/1/x?do=502", key=ADMIN)
        tries = attempts(journal, "/x?do=502")
        assert code == 502 and len(tries) == 1 and tries[0]["port"] == ports(f)[1]
        assert f.doc()["retries"] == 0
        # A stream that fails before its head is sent again like any request; it is the one retry counted.
        code, _, answer = ask(f, "/v1/completions?do=reset,stream", b'{"stream": true}')
        assert code == 200 and answer.endswith(b"0\r\n\r\n") and answer.count(b"data: ") == 3
        f.wait(lambda d: d["retries"] == 1, timeout=30)
    finally:
        assert f.stop() == 0


def test_the_second_attempt_avoids_the_failed_copy_under_load_or_reuses_the_only_one(tmp_path: Path) -> None:
    f, journal = scripted(tmp_path)
    try:
        # Concurrent requests move the round robin between a request's two attempts: the retry still goes to the
        # copy that did not fail it.
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(lambda i: ask(f, f"/v1/completions?id={i}&do=close,ok")[0], range(48)))
        assert codes == [200] * 48
        for i in range(48):
            tries = attempts(journal, f"/v1/completions?id={i}&do=close,ok")
            assert len(tries) == 2 and tries[0]["port"] != tries[1]["port"], tries
        f.wait(lambda d: d["retries"] == 48, timeout=30)
        # A held copy takes no retry either: with copy 0 held, both attempts go to copy 1.
        assert ask(f, "/kimictl/front/router/0/hold?seconds=60", b"", key=ADMIN)[0] == 200
        target = "/v1/completions?held=1&do=close,ok"
        assert ask(f, target)[0] == 200
        assert [t["port"] for t in attempts(journal, target)] == [ports(f)[1]] * 2
    finally:
        assert f.stop() == 0
    # One copy: the second attempt goes to it again (its router picks another engine instance).
    (tmp_path / "one").mkdir()
    one, journal = scripted(tmp_path / "one", routers=1)
    try:
        target = "/v1/completions?do=502,ok"
        assert ask(one, target)[0] == 200
        assert [t["port"] for t in attempts(journal, target)] == ports(one) * 2
        one.wait(lambda d: d["retries"] == 1, timeout=30)
    finally:
        assert one.stop() == 0


# --- a 200 with an empty body (vllm-ascend's proxy when the decode engine dies before the first token) -----------

HOLD_MAX = 8 * 1024 * 1024  # proxy_front.HOLD_MAX: larger answers go out as they come
GENERATE = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4}).encode()  # non-streaming


def dechunk(raw: bytes) -> tuple[bytes, bool]:
    """(the body, whether its last chunk came) of a chunked body as the client got it."""
    out = []
    while raw:
        line, _, raw = raw.partition(b"\r\n")
        size = int(line.split(b";")[0], 16)
        if size == 0:
            return b"".join(out), raw == b"\r\n"
        out.append(raw[:size])
        raw = raw[size + 2:]
    return b"".join(out), False


def check_big(top: bytes, answer: bytes, size: int, port: int) -> None:
    """The router's big-N answer reached the client byte for byte (its head and its chunked body as sent)."""
    sha = re.search(rb"\r\nx-body-sha256: ([0-9a-f]{64})$", top)
    assert top.startswith(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n")
    assert sha and hashlib.sha256(answer).hexdigest() == sha.group(1).decode(), (len(answer), size)
    body, ended = dechunk(answer)
    assert ended and len(body) == size and json.loads(body)["port"] == port


def test_an_empty_answer_to_a_non_streaming_generation_request_is_sent_once_more(tmp_path: Path) -> None:
    f, journal = scripted(tmp_path)
    try:
        cases = [("/v1/completions", "empty"), ("/v1/chat/completions", "empty-length"),
                 ("/v1/completions", "cut-json"), ("/v1/chat/completions", "stream-cut")]
        for n, (path, first) in enumerate(cases, 1):
            target = f"{path}?do={first},big-70000"
            code, top, answer = ask(f, target, GENERATE)
            tries = attempts(journal, target)
            assert code == 200 and len(tries) == 2 and tries[0]["port"] != tries[1]["port"], (first, tries)
            check_big(top, answer, 70000, tries[1]["port"])  # the second copy's answer, only it, as it sent it
            f.wait(lambda d, n=n: d["retries"] == n, timeout=30)
        log = f.log_path.read_text()
        for text in ("answered 200 with an empty body", "answered 200 with a body that is not a JSON object "
                     '({"id":"cmpl-1","choices":[{"text":"Hel)', "answered 200, then closed the connection"):
            assert re.search(r"router \d " + re.escape(text) + r".* sent once more, to router \d", log), text

        # Both copies answer empty: the front's 502, in the OpenAI error shape, after exactly two attempts.
        target = "/v1/completions?do=empty,empty-length"
        code, top, answer = ask(f, target, b'{"prompt": "hi", "stream": false}')
        assert code == 502 and len(attempts(journal, target)) == 2
        error = json.loads(answer)["error"]
        assert error["code"] == 502 and "answered 200 with an empty body, then router" in error["message"]
        f.wait(lambda d: d["retries"] == len(cases) + 1, timeout=30)
    finally:
        assert f.stop() == 0


def test_what_is_relayed_as_it_comes(tmp_path: Path) -> None:
    f, journal = scripted(tmp_path)
    try:
        # A streaming request's empty 200 is its answer (as before): relayed once, never held.
        target = "/v1/completions?do=empty"
        code, top, answer = ask(f, target, b'{"prompt": "hi", "stream": true}')
        assert code == 200 and b"server: uvicorn" in top and answer == b"0\r\n\r\n"
        assert len(attempts(journal, target)) == 1
        # So is one whose body is no JSON object (the front cannot tell), and one on another path.
        for target, body in [("/v1/chat/completions?do=empty-length", b"not json"),
                             ("/v1/completions?x=1&do=empty-length", b"[]"), ("/v1/embeddings?do=empty-length", b"{}")]:
            code, top, answer = ask(f, target, body)
            assert code == 200 and answer == b"" and len(attempts(journal, target)) == 1, target
        # A large answer under the cap is held whole and relayed intact, once.
        size = 3 * 1024 * 1024
        code, top, answer = ask(f, f"/v1/completions?do=big-{size}", GENERATE)
        tries = attempts(journal, f"/v1/completions?do=big-{size}")
        assert code == 200 and len(tries) == 1
        check_big(top, answer, size, tries[0]["port"])
        # ... and held whole, one cut short under the cap is sent again (nothing reached the client) ...
        code, top, answer = ask(f, f"/v1/completions?do=big-{size}-cut,big-{size}", GENERATE)
        tries = attempts(journal, f"/v1/completions?do=big-{size}-cut,big-{size}")
        assert code == 200 and len(tries) == 2
        check_big(top, answer, size, tries[1]["port"])
        # ... while one over the cap goes out as it comes: intact when whole, cut (and not sent again) when cut.
        size = HOLD_MAX + 1024 * 1024
        code, top, answer = ask(f, f"/v1/completions?do=big-{size}", GENERATE)
        tries = attempts(journal, f"/v1/completions?do=big-{size}")
        assert code == 200 and len(tries) == 1
        check_big(top, answer, size, tries[0]["port"])
        code, top, answer = ask(f, f"/v1/completions?do=big-{size}-cut,big-{size}", GENERATE)
        tries = attempts(journal, f"/v1/completions?do=big-{size}-cut,big-{size}")
        assert code == 200 and len(tries) == 1 and len(answer) > HOLD_MAX and not dechunk(answer)[1]
        f.wait(lambda d: d["retries"] == 1, timeout=30)
    finally:
        assert f.stop() == 0


def test_an_answer_is_held_no_longer_than_the_request_timeout(tmp_path: Path) -> None:
    f, journal = scripted(tmp_path, extra=("--request-timeout", "0.5"))
    try:
        # The empty body ends 2 s after the head: by then the head went out, so it is relayed as before.
        target = "/v1/completions?do=empty-late"
        code, top, answer = ask(f, target, GENERATE)
        assert code == 200 and b"server: uvicorn" in top and answer == b"0\r\n\r\n"
        assert len(attempts(journal, target)) == 1
        # One that ends within it is still sent once more.
        target = "/v1/completions?do=empty,ok"
        code, top, answer = ask(f, target, GENERATE)
        assert code == 200 and json.loads(answer) == {"port": attempts(journal, target)[1]["port"]}
    finally:
        assert f.stop() == 0
