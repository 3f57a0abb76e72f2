"""The proxy front sends a request once more, to another router copy when one is up, when its router failed before
any byte of the answer went to the client (closed or reset before a response head, or answered 500/502/503/504);
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


def scripted(tmp: Path, routers: int = 2) -> tuple[Front, Path]:
    journal = tmp / "journal"
    journal.write_text("")
    return Front(tmp, routers=routers, router=ROUTER, env={"SCRIPTED_ROUTER_JOURNAL": str(journal)}), journal


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
            f.wait(lambda d, n=n: d["retries"] == n, timeout=5)
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
        f.wait(lambda d: d["retries"] == len(failures) + 2, timeout=5)
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
        f.wait(lambda d: d["retries"] == 1, timeout=5)
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
        f.wait(lambda d: d["retries"] == 48, timeout=5)
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
        one.wait(lambda d: d["retries"] == 1, timeout=5)
    finally:
        assert one.stop() == 0
