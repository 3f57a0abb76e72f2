"""The engines of a slice over HTTP: the drain wait (until a drained slice holds and serves nothing), and the pair
probe (one P/D hand-over between two given endpoints, the way the P/D proxies do it). The routers' clients are
kimictl.routers.

HTTP goes through `http` (default `kimictl.health`); tests pass fakes."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from kimictl import health
from kimictl.slices.model import Endpoint

# --- drain and probes -------------------------------------------------------------------------------------


# (busy, activity) or (busy, activity, running); None: the endpoint does not answer.
Sample = Callable[[Endpoint], "tuple[float, tuple[float, ...]] | tuple[float, tuple[float, ...], float] | None"]


def drain_sampler(busy: list[str], activity: list[str], http: Any = health, running: list[str] | None = None,
                  ) -> Sample:
    """What a drained endpoint still holds (the sum of the engine profile's busy gauges) and whether it served
    anything (its activity counters), and with `running` the sum of those gauges (requests in its batch); None when
    it does not answer (nothing can still be in flight there)."""

    def sample(ep: Endpoint) -> tuple[float, tuple[float, ...]] | tuple[float, tuple[float, ...], float] | None:
        totals = http.metric_totals(ep.ip, ep.port, timeout=3.0)
        if not totals:
            return None
        got = sum(totals.get(g, 0.0) for g in busy), tuple(totals.get(c, 0.0) for c in activity)
        return got if running is None else (*got, sum(totals.get(g, 0.0) for g in running))

    return sample


def wait_drained(endpoints: list[Endpoint], *, timeout: float, quiet: float, sample: Sample,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 stuck: float | None = None) -> dict[str, Any]:
    """Wait until no endpoint runs, queues or holds anything and none served a request for `quiet` seconds (a
    request the router paired with it just before the drain may still be in its prefill elsewhere). With `stuck`
    (and a sample that reports running requests), an endpoint whose requests run while none of its activity counters
    moved for `stuck` seconds is not waited for: it makes no progress, they cannot finish. Returns {seconds,
    timed_out: [engine ids still busy when the timeout hit], stuck: [engine ids given up as stuck]}."""
    t0 = clock()
    last: dict[str, tuple[float, ...] | None] = {}
    quiet_since: dict[str, float] = {}
    moved_at: dict[str, float] = {}
    given_up: list[str] = []
    pending = {ep.engine: ep for ep in endpoints}
    while pending:
        now = clock()
        for eid, ep in list(pending.items()):
            got = sample(ep)
            if got is None:
                del pending[eid]
                continue
            busy, activity, *more = got
            if last.get(eid) != activity:
                moved_at[eid] = now
            if busy > 0 or last.get(eid) != activity:
                quiet_since[eid] = now
            last[eid] = activity
            if busy == 0 and now - quiet_since.setdefault(eid, now) >= quiet:
                del pending[eid]
            elif stuck is not None and more and more[0] > 0 and now - moved_at[eid] >= stuck:
                given_up.append(eid)
                del pending[eid]
        if not pending:
            break
        if clock() - t0 > timeout:
            return {"seconds": round(clock() - t0, 2), "timed_out": sorted(pending), "stuck": sorted(given_up)}
        sleep(0.25)
    return {"seconds": round(clock() - t0, 2), "timed_out": [], "stuck": sorted(given_up)}


def _completion(http: Any, url: str, body: dict[str, Any], request_id: str, timeout: float,
                api_key: str | None = None) -> tuple[int, Any]:
    code, text = http.http_request("POST", url, body, timeout=timeout, headers={"X-Request-Id": request_id},
                                   api_key=api_key)
    try:
        return code, json.loads(text)
    except ValueError:
        return code, text


def pair_probe(p: Endpoint, d: Endpoint, served: str, timeout: float = 60.0, http: Any = health,
               api_key: str | None = None) -> dict[str, Any]:
    """One P/D hand-over between exactly these two endpoints, the way the P/D proxies do it: the prefill engine
    prefills with `do_remote_decode` (one token, not streamed) and returns kv_transfer_params, the decode engine
    pulls the KV with them. Both sides' counters must move. `api_key`: the key the engines require. A failure that
    got no HTTP answer in time (or none at all) says `unanswered`: slow is not broken (heal judges a hang by
    progress, not by a probe's time)."""
    t0 = time.monotonic()
    before_p = http.metric_totals(p.ip, p.port).get(health.PREFILL_COUNTER, 0.0)
    before_d = http.metric_totals(d.ip, d.port).get(health.DECODE_COUNTER, 0.0)
    rid = f"___prefill_addr_{p.ip}:{p.port}___decode_addr_{d.ip}:{d.port}_{uuid.uuid4().hex}"
    prompt = health.smoke_prompt(96)
    code, body = _completion(http, f"{p.url}/v1/completions", {
        "model": served, "prompt": prompt, "max_tokens": 1, "min_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                               "remote_block_ids": None, "remote_host": None, "remote_port": None}}, rid, timeout,
        api_key)
    result: dict[str, Any] = {"prefill": p.engine, "decode": d.engine, "ok": False}
    kv = body.get("kv_transfer_params") if isinstance(body, dict) else None
    if code != 200 or not isinstance(kv, dict):
        result.update(detail=f"prefill {p.engine} at {p.url}: HTTP {code}: {health.body_text(body)}",
                      unanswered=code == 0)
        return result
    code, body = _completion(http, f"{d.url}/v1/completions", {"model": served, "prompt": prompt, "max_tokens": 4,
                                                               "kv_transfer_params": kv}, rid, timeout, api_key)
    if code != 200 or not isinstance(body, dict) or not body.get("choices"):
        result.update(detail=f"decode {d.engine} at {d.url} (KV from {p.engine}): HTTP {code}: "
                             f"{health.body_text(body)}", unanswered=code == 0)
        return result
    moved_p = http.metric_totals(p.ip, p.port).get(health.PREFILL_COUNTER, 0.0) - before_p
    moved_d = http.metric_totals(d.ip, d.port).get(health.DECODE_COUNTER, 0.0) - before_d
    result.update(ok=moved_p > 0 and moved_d > 0, seconds=round(time.monotonic() - t0, 2),
                  detail=f"prefill prompt tokens +{moved_p:.0f}, decode external prefix cache +{moved_d:.0f}")
    return result
