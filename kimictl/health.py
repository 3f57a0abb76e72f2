"""HTTP probes of engines and the proxy: readiness (/health + /v1/models), /metrics counters, completions."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

# Counters that prove a completion went prefill -> decode (vLLM's own names; the simulator exports them too).
PREFILL_COUNTER = "vllm:prompt_tokens"
DECODE_COUNTER = "vllm:external_prefix_cache_queries"
GENERATION_COUNTER = "vllm:generation_tokens"
# Where an engine's prompt tokens came from (vLLM's PromptTokenStats): a decode engine that really got the KV counts
# every prompt token as external_kv_transfer and computes none (local_compute) itself.
PROMPT_SOURCES = "vllm:prompt_tokens_by_source"
EXTERNAL, LOCAL_COMPUTE = "external_kv_transfer", "local_compute"


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


def prompt_sources(endpoints: list[tuple[str, int]], timeout: float = 3.0, http: Any = None) -> dict[str, float] | None:
    """vllm:prompt_tokens_by_source_total per source, summed over the endpoints; None when none exports it."""
    from prometheus_client.parser import text_string_to_metric_families

    get = http.http_get if http else http_get
    out: dict[str, float] | None = None
    for ip, port in endpoints:
        code, text = get(f"http://{ip}:{port}/metrics", timeout)
        if code != 200:
            continue
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        for fam in families:
            if fam.name != PROMPT_SOURCES:
                continue
            out = out if out is not None else {}
            for s in fam.samples:
                if s.name.endswith("_total") and "source" in s.labels:
                    out[s.labels["source"]] = out.get(s.labels["source"], 0.0) + float(s.value)
    return out


def completed(code: int, body: Any) -> bool:
    """A completion came back (vllm-ascend's proxy answers 200 with an empty body when the decode leg fails)."""
    return code == 200 and isinstance(body, dict) and bool(body.get("choices"))


@dataclass
class PdProbe:
    """One completion through the proxy, judged by what the decode side really got over the KV connector."""

    ok: bool
    code: int
    body: Any
    prompt_tokens: float            # the prompt's length (usage.prompt_tokens of the answer)
    prefill_prompt_tokens: float    # vllm:prompt_tokens the prefill side counted meanwhile
    external_kv_transfer: float     # decode's prompt tokens that arrived over the connector meanwhile
    local_compute: float            # decode's prompt tokens it computed itself meanwhile (a fallback when > 0)
    detail: str

    @property
    def answered(self) -> bool:
        return completed(self.code, self.body)

    def counters(self) -> dict[str, float]:
        return {"prompt_tokens": self.prompt_tokens, "prefill_prompt_tokens": self.prefill_prompt_tokens,
                "decode_external_kv_transfer_tokens": self.external_kv_transfer,
                "decode_local_compute_tokens": self.local_compute}


def pd_probe(url: str, model: str, prefill: list[tuple[str, int]], decode: list[tuple[str, int]], *,
             words: int = 64, max_tokens: int = 2, timeout: float = 60.0, api_key: str | None = None,
             http: Any = None) -> PdProbe:
    """Send one completion through the P/D proxy; it passes when decode's external_kv_transfer rose by at least the
    prompt's tokens and its local_compute did not rise (the prompt begins with a fresh nonce, so no prefix cache
    serves it). Engines that do not export vllm:prompt_tokens_by_source are judged by prefill's prompt tokens and
    decode's external prefix cache queries both rising. `http`: this module's HTTP functions, or a stand-in."""
    http = http or SimpleNamespace(metric_totals=metric_totals, http_post_json=http_post_json, http_get=http_get)

    def prefill_tokens() -> float:
        return sum(http.metric_totals(ip, port).get(PREFILL_COUNTER, 0.0) for ip, port in prefill)

    def decode_queries() -> float:
        return sum(http.metric_totals(ip, port).get(DECODE_COUNTER, 0.0) for ip, port in decode)

    p0, s0, q0 = prefill_tokens(), prompt_sources(decode, http=http), decode_queries()
    code, body = http.http_post_json(url, {"model": model, "prompt": smoke_prompt(words, nonce=True),
                                           "max_tokens": max_tokens, "temperature": 0}, timeout=timeout,
                                     api_key=api_key)
    p1, s1, q1 = prefill_tokens(), prompt_sources(decode, http=http), decode_queries()
    usage = body.get("usage") if isinstance(body, dict) else None
    prompt = float(usage.get("prompt_tokens") or 0) if isinstance(usage, dict) else 0.0
    answered = completed(code, body)
    head = f"HTTP {code}" + (" without a completion" if code == 200 and not answered else "")
    moved_p = p1 - p0
    if s0 is None or s1 is None:
        moved_q = q1 - q0
        ok = answered and moved_p > 0 and moved_q > 0
        why = (f"prefill prompt tokens +{moved_p:.0f}, decode external prefix cache queries +{moved_q:.0f} "
               f"(decode exports no {PROMPT_SOURCES})")
        return PdProbe(ok, code, body, prompt, moved_p, moved_q, 0.0, f"{head}; {why}")
    ext = s1.get(EXTERNAL, 0.0) - s0.get(EXTERNAL, 0.0)
    local = s1.get(LOCAL_COMPUTE, 0.0) - s0.get(LOCAL_COMPUTE, 0.0)
    ok = answered and prompt > 0 and ext >= prompt and local == 0
    why = (f"prompt {prompt:.0f} tokens; decode got +{ext:.0f} over the KV connector and computed +{local:.0f} "
           f"itself; prefill prompt tokens +{moved_p:.0f}")
    if answered and not ok:
        why += ("; decode recomputed the prompt (KV transfer failed or fell back)" if local > 0 else
                "; decode did not get the prompt's KV")
    return PdProbe(ok, code, body, prompt, moved_p, ext, local, f"{head}; {why}")


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


def smoke_prompt(words: int = 400, nonce: bool = False) -> str:
    """A long prompt so prefill has real work and several KV blocks to hand over; with `nonce` it begins with a
    fresh random word, so no engine's prefix cache holds any of it (the KV must really move)."""
    base = ("Kimi K2.5 serves on Atlas hosts with prefill and decode split across engines; the decode side pulls "
            "the KV cache of this prompt from the prefill side before it generates. ").split()
    text = " ".join(base[i % len(base)] for i in range(words))
    return f"{uuid.uuid4().hex[:12]} {text}" if nonce else text
