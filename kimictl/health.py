"""HTTP probes of engines and the proxy: readiness (/health + /v1/models), /metrics counters, completions."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

# Counters that prove a completion went prefill -> decode (vLLM's own names; the simulator exports them too).
PREFILL_COUNTER = "vllm:prompt_tokens"
DECODE_COUNTER = "vllm:external_prefix_cache_queries"
GENERATION_COUNTER = "vllm:generation_tokens"


@dataclass
class Ready:
    ok: bool
    detail: str


def http_request(method: str, url: str, body: Any = None, timeout: float = 10.0,
                 headers: dict[str, str] | None = None, api_key: str | None = None) -> tuple[int, str]:
    """(status, body text); status 0 with the reason when the server cannot be reached."""
    hdrs = {"Content-Type": "application/json"} if body is not None else {}
    if api_key:
        hdrs["Authorization"] = f"Bearer {api_key}"
    hdrs.update(headers or {})
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        return 0, str(getattr(exc, "reason", exc))


def http_get(url: str, timeout: float = 3.0, api_key: str | None = None) -> tuple[int, str]:
    return http_request("GET", url, timeout=timeout, api_key=api_key)


def http_post_json(url: str, body: dict[str, Any], timeout: float = 60.0,
                   api_key: str | None = None) -> tuple[int, Any]:
    """POST JSON; the reply parsed as JSON when it is JSON."""
    status, text = http_request("POST", url, body, timeout, api_key=api_key)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def body_text(body: Any, limit: int = 200) -> str:
    """An HTTP reply for a message: JSON as JSON (never a Python repr), cut to `limit` characters."""
    text = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return text[:limit]


def engine_ready(ip: str, port: int, served_name: str, timeout: float = 3.0, api_key: str | None = None) -> Ready:
    """Model-aware readiness: /health is 200 and /v1/models lists the served model name."""
    code, text = http_get(f"http://{ip}:{port}/health", timeout, api_key)
    if code != 200:
        return Ready(False, f"/health {code or 'unreachable'}: {text[:120]}")
    code, text = http_get(f"http://{ip}:{port}/v1/models", timeout, api_key)
    if code != 200:
        return Ready(False, f"/v1/models {code}")
    try:
        names = [m.get("id") for m in json.loads(text).get("data", [])]
    except (ValueError, AttributeError):
        return Ready(False, "/v1/models is not JSON")
    if served_name not in names:
        return Ready(False, f"/v1/models lists {names}, not {served_name}")
    return Ready(True, "ready")


def scrape(ip: str, port: int, timeout: float = 3.0) -> tuple[dict[str, float], dict[str, list[tuple[float, float]]]]:
    """(sum of each counter/gauge over its labels, cumulative histogram buckets per family) from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    code, text = http_get(f"http://{ip}:{port}/metrics", timeout)
    totals: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    if code != 200:
        return totals, {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels.get("le", "inf"))
                per = buckets.setdefault(fam.name, {})
                per[le] = per.get(le, 0.0) + float(s.value)
                continue
            if s.name.endswith("_created"):
                continue
            totals[s.name] = totals.get(s.name, 0.0) + float(s.value)
            if s.name.endswith("_total"):  # counters: also under the family name
                totals[fam.name] = totals.get(fam.name, 0.0) + float(s.value)
    return totals, {k: sorted(v.items()) for k, v in buckets.items()}


def metric_totals(ip: str, port: int, timeout: float = 3.0) -> dict[str, float]:
    return scrape(ip, port, timeout)[0]


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style histogram_quantile over cumulative (le, count) buckets; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            width = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / width if width else 0.0)
        prev_le, prev_count = le, count
    return prev_le


def smoke_prompt(words: int = 400) -> str:
    """A long, deterministic prompt so prefill has real work and several KV blocks to hand over."""
    base = ("Kimi K2.5 serves on Atlas hosts with prefill and decode split across engines; the decode side pulls "
            "the KV cache of this prompt from the prefill side before it generates. ").split()
    return " ".join(base[i % len(base)] for i in range(words))
