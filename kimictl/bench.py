"""Load run through the serving endpoint: fixed request count/ISL/OSL/concurrency, TTFT/TPOT percentiles vs SLO."""

from __future__ import annotations

import http.client
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kimictl import health
from kimictl.errors import InvalidInput

if TYPE_CHECKING:
    from kimictl.render import Rendered


@dataclass
class BenchSpec:
    requests: int = 64
    concurrency: int = 8
    input_tokens: int = 512
    output_tokens: int = 64
    timeout_s: float = 300.0
    slo_tpot_ms: float = 50.0  # the source article's online target
    slo_ttft_ms: float | None = None


@dataclass
class Sample:
    ok: bool
    ttft_s: float = 0.0
    tpot_s: float | None = None
    output_tokens: int = 0
    error: str = ""


@dataclass
class BenchResult:
    url: str
    spec: BenchSpec
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0

    def _pcts(self, values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"p50": None, "p90": None, "p99": None}
        qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
        return {"p50": qs[49], "p90": qs[89], "p99": qs[98]}

    def summary(self) -> dict[str, Any]:
        ok = [s for s in self.samples if s.ok]
        ttft = self._pcts([s.ttft_s * 1000 for s in ok])
        tpot = self._pcts([s.tpot_s * 1000 for s in ok if s.tpot_s is not None])
        tokens = sum(s.output_tokens for s in ok)
        misses = []
        if len(ok) < len(self.samples):
            misses.append(f"{len(self.samples) - len(ok)} request(s) failed")
        if tpot["p90"] is not None and tpot["p90"] > self.spec.slo_tpot_ms:
            misses.append(f"TPOT p90 {tpot['p90']:.1f} ms > SLO {self.spec.slo_tpot_ms:g} ms")
        if self.spec.slo_ttft_ms and ttft["p90"] is not None and ttft["p90"] > self.spec.slo_ttft_ms:
            misses.append(f"TTFT p90 {ttft['p90']:.1f} ms > SLO {self.spec.slo_ttft_ms:g} ms")
        return {
            "schema_version": 1, "url": self.url, "requests": len(self.samples), "succeeded": len(ok),
            "concurrency": self.spec.concurrency, "input_tokens": self.spec.input_tokens,
            "output_tokens": self.spec.output_tokens, "wall_s": round(self.wall_s, 2),
            "ttft_ms": ttft, "tpot_ms": tpot,
            "output_tokens_per_s": round(tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "requests_per_s": round(len(ok) / self.wall_s, 2) if self.wall_s else 0.0,
            "slo": {"tpot_ms": self.spec.slo_tpot_ms, "ttft_ms": self.spec.slo_ttft_ms, "met": not misses,
                    "misses": misses},
            "errors": sorted({s.error for s in self.samples if not s.ok})[:5],
        }


def _one(host: str, port: int, model: str, prompt: str, spec: BenchSpec, deadline: float,
         api_key: str | None = None) -> Sample:
    """One streamed completion; TTFT = first text chunk, TPOT = mean gap between later tokens."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": spec.output_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0})
    t0 = time.monotonic()
    timeout = max(1.0, min(spec.timeout_s, deadline - t0))
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        conn.request("POST", "/v1/completions", body, headers)
        resp = conn.getresponse()
        if resp.status != 200:
            return Sample(False, error=f"HTTP {resp.status}: {resp.read()[:160]!r}")
        first = last = None
        chunks = 0
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            try:
                text = json.loads(line[5:])["choices"][0].get("text", "")
            except (ValueError, KeyError, IndexError):
                continue
            if not text:
                continue
            now = time.monotonic()
            first = first or now
            last = now
            chunks += 1
        if first is None:
            return Sample(False, error="no tokens streamed")
        tpot = (last - first) / (chunks - 1) if chunks > 1 else None
        return Sample(True, ttft_s=first - t0, tpot_s=tpot, output_tokens=chunks)
    except (OSError, http.client.HTTPException) as exc:
        return Sample(False, error=f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def check_fits(spec: BenchSpec, rendered: Rendered | None) -> None:
    """Exit 2 before any endpoint is loaded when every request would be longer than the max-model-len the cluster
    was deployed with (`rendered`: its render, when this control node knows it; a role without the flag is not
    judged): the prompt has at least --input-tokens tokens (one word each) and asks for --output-tokens more."""
    if rendered is None:
        return
    limits = {role: n for role, rc in rendered.plan.role_config.items()
              if (n := _whole(rc.serve.get("max-model-len"))) is not None}
    if not limits:
        return
    role = min(limits, key=limits.__getitem__)
    if spec.input_tokens + spec.output_tokens > limits[role]:
        raise InvalidInput(f"--input-tokens {spec.input_tokens} with --output-tokens {spec.output_tokens}: every "
                           f"request would be longer than the max-model-len {limits[role]} the {role} engines of "
                           f"{rendered.plan.cluster} are deployed with, and they refuse it",
                           hint=f"keep --input-tokens + --output-tokens within {limits[role]}")


def _whole(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return int(value) if isinstance(value, str) and value.isascii() and value.isdigit() else None


def run_bench(host: str, port: int, model: str, spec: BenchSpec, api_key: str | None = None) -> BenchResult:
    """Send spec.requests completions with spec.concurrency in flight; bounded by spec.timeout_s overall."""
    prompt = health.smoke_prompt(spec.input_tokens)
    res = BenchResult(f"http://{host}:{port}/v1/completions", spec)
    t0 = time.monotonic()
    deadline = t0 + spec.timeout_s
    with ThreadPoolExecutor(max_workers=spec.concurrency) as pool:
        futures = [pool.submit(_one, host, port, model, prompt, spec, deadline, api_key)
                   for _ in range(spec.requests)]
        res.samples = [f.result() for f in futures]
    res.wall_s = time.monotonic() - t0
    return res
