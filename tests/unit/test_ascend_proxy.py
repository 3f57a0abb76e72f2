"""vllm-ascend's own P/D proxy (the real upstream file, from the pinned sdist) in front of simulated engines: what it
sends the engines, and what a client gets back when a decode engine runs out of KV cache and its RecomputeScheduler
ends requests as "recomputed" (the sandbox fault kv-pressure)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import pytest
from prerequisites import require_or_skip
from test_engine_sim import (  # the simulator harness: fixtures and helpers
    MODEL,
    PROMPT,
    free_port,
    http,
    pd_pair,  # noqa: F401
    simhost,  # noqa: F401
    sse_events,
)

from kimictl.facts import version_profile
from kimictl.router_kinds import router_kind
from kimictl.upstream import UpstreamUnavailable, release_of, upstream_file

pytestmark = pytest.mark.slow
KIND = router_kind("vllm-ascend-proxy")


def _script():
    missing = [m for m in KIND.python_modules if importlib.util.find_spec(m) is None]
    if missing:
        require_or_skip(f"the upstream proxy needs {', '.join(missing)} (the test extra)")
    try:
        return upstream_file(release_of(version_profile(None).image_tag), str(KIND.script))
    except UpstreamUnavailable as exc:
        require_or_skip(str(exc))


@pytest.fixture
def proxy(pd_pair, simhost):  # noqa: F811
    prefill, decode, _ = pd_pair
    port = free_port()
    log = simhost.root / "proxy.log"
    argv = [sys.executable, str(_script()), "--host", "127.0.0.1", "--port", str(port),
            "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(prefill.port),
            "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(decode.port), *KIND.args]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=simhost.root)
    simhost.others.append(proc)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if http("GET", f"{url}{KIND.health_path}", timeout=2)[0] == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    return url, prefill, decode


def _stream_tokens(raw: bytes, chat: bool = False) -> tuple[list[str], list[dict]]:
    """The text pieces a streaming client sees, and the choice of every chunk."""
    choices = [c for e in sse_events(raw) if e != "[DONE]" for c in json.loads(e)["choices"]]
    key = (lambda c: c.get("delta", {}).get("content")) if chat else (lambda c: c.get("text"))
    return [key(c) for c in choices if key(c)], choices


def test_completions_and_chat_pass_with_the_prefill_leg_clamped(proxy) -> None:
    url, prefill, decode = proxy
    status, body, _ = http("POST", f"{url}/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 6,
                                                             "ignore_eos": True})
    assert status == 200, body
    doc = json.loads(body)
    assert doc["usage"]["completion_tokens"] == 6 and doc["choices"][0]["finish_reason"] == "length"
    status, raw, _ = http("POST", f"{url}/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5,
                                                            "ignore_eos": True, "stream": True})
    assert status == 200 and len(_stream_tokens(raw)[0]) == 5 and sse_events(raw)[-1] == "[DONE]"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": 7,
            "ignore_eos": True}
    status, body, _ = http("POST", f"{url}/v1/chat/completions", chat)
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 7
    p, d = prefill.metrics(), decode.metrics()
    # every request went prefill -> decode; the prefill leg was clamped to one token (max_completion_tokens too)
    assert p["kimi_sim:kv_transfer_sent_requests_total"] == 3 == d["kimi_sim:kv_transfer_pulled_requests_total"]
    assert p["vllm:generation_tokens_total"] == 3 and d["vllm:generation_tokens_total"] == 18
    # it adds no field vLLM does not know (vllm-router does), and sends a request id and a bearer header
    assert "present in the request but ignored" not in prefill.logs() + decode.logs()


def test_a_key_on_the_engines_is_sent_by_the_proxy_from_its_environment(simhost) -> None:  # noqa: F811
    from test_engine_sim import decode_argv, free_port_range, prefill_argv

    key = "sk-engine-key-3f9a"
    prefill = simhost.start(prefill_argv(free_port(), free_port_range(8)), devices="0,1,2,3,4,5,6,7",
                            VLLM_API_KEY=key)
    decode = simhost.start(decode_argv(free_port(), free_port_range(4)), devices="8,9,10,11", VLLM_API_KEY=key)
    prefill.wait_ready()
    decode.wait_ready()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
    assert http("POST", f"{decode.url}/v1/completions", body)[0] == 401
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "OPENAI_API_KEY": key}
    proc = subprocess.Popen([sys.executable, str(_script()), "--host", "127.0.0.1", "--port", str(port),
                             "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(prefill.port),
                             "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(decode.port), *KIND.args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=simhost.root)
    simhost.others.append(proc)
    deadline = time.monotonic() + 60
    while True:
        try:
            if http("GET", f"http://127.0.0.1:{port}/healthcheck", timeout=2)[0] == 200:
                break
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    status, raw, _ = http("POST", f"http://127.0.0.1:{port}/v1/completions", body)
    assert status == 200, raw


def upstream_nonstream_tokens(max_tokens: int, after: int) -> tuple[int, int]:
    """(tokens, replays) the upstream proxy's arithmetic gives a non-streamed completion when every decode leg is
    recomputed after `after` tokens: it counts usage.completion_tokens (exact) but adds the replay count, meant to
    make up for the empty recompute chunk a stream counts, to each replay's max_tokens."""
    done = replays = 0
    left = max_tokens
    while left > after:
        done, replays = done + after, replays + 1
        left = max_tokens - done + replays
    return done + left, replays


def test_kv_pressure_recomputed_requests_are_replayed_by_the_proxy(proxy, simhost) -> None:  # noqa: F811
    url, _prefill, decode = proxy
    (simhost.state / "faults.json").write_text(json.dumps({"kv_pressure_tokens": 4}))
    before = decode.metrics()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 64, "ignore_eos": True}

    # streaming: exactly what was asked for, in order, ending like an unpressured request
    status, raw, _ = http("POST", f"{url}/v1/completions", {**body, "stream": True}, timeout=120)
    assert status == 200, raw
    tokens, choices = _stream_tokens(raw)
    assert len(tokens) == 64
    assert choices[-1]["finish_reason"] == "length" and all(c.get("stop_reason") != "recomputed" for c in choices)
    after = decode.metrics()
    legs = after["vllm:request_success_total{stop}"] - before["vllm:request_success_total{stop}"]
    assert legs == 15  # 15 legs of 4 tokens were recomputed, the 16th finished the last 4

    # not streamed: the proxy over-generates by one token per replay (upstream 0.23.0.post1), and usage is the
    # last leg's; the text is every leg's
    status, raw, _ = http("POST", f"{url}/v1/completions", body, timeout=120)
    assert status == 200, raw
    doc = json.loads(raw)
    want, replays = upstream_nonstream_tokens(64, 4)
    assert (want, replays) == (84, 20)
    assert len(doc["choices"][0]["text"].split()) == want
    assert doc["choices"][0]["finish_reason"] == "length" and doc["usage"]["completion_tokens"] == 4

    # chat, streamed: each leg's first chunk (the assistant role, no text) is counted as a token too and reaches the
    # client again, so a stream falls one token short per replay (64 -> 52 with 12 replays)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 64, "ignore_eos": True,
            "stream": True}
    status, raw, _ = http("POST", f"{url}/v1/chat/completions", chat, timeout=120)
    assert status == 200, raw
    tokens, choices = _stream_tokens(raw, chat=True)
    roles = sum(1 for c in choices if c.get("delta", {}).get("role"))
    assert (len(tokens), roles) == (52, 13) and choices[-1]["finish_reason"] == "length"

    # cleared: a plain hand-over again
    (simhost.state / "faults.json").write_text("{}")
    before = decode.metrics()
    status, raw, _ = http("POST", f"{url}/v1/completions", body, timeout=60)
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 64
    assert decode.metrics()["vllm:request_success_total{stop}"] == before["vllm:request_success_total{stop}"]
