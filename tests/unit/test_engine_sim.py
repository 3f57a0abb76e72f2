"""End-to-end tests of the engine simulator, run as `python3 engine_sim.py serve ...` on 127.0.0.1."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from prerequisites import require_or_skip
from prometheus_client.parser import text_string_to_metric_families

import kimictl.sandbox.engine_sim as es
from kimictl import health

SIM = Path(es.__file__)
# The fake hosts run the sim with the system interpreter and no venv; do the same when it exists.
# the sandbox hosts' python3 (KIMICTL_HOST_PYTHON: the host Python floor's, from scripts/test.sh)
PYTHON = os.environ.get("KIMICTL_HOST_PYTHON") or ("/usr/bin/python3" if Path("/usr/bin/python3").exists()
                                                   else sys.executable)
STARTUP_TIMEOUT = 20.0
MODEL = "kimi-k2.5"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_range(count: int) -> int:
    """A base port with `count` consecutive free ports (the side channel takes one per TP worker)."""
    for _ in range(200):
        base = random.randrange(30000, 60000 - count)
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free port range")


def kv_config(role: str, kv_port: int, engine_id: str) -> str:
    return json.dumps(
        {
            "kv_connector": "MooncakeConnectorV1",
            "kv_role": role,
            "kv_port": str(kv_port),
            "engine_id": engine_id,
            "kv_connector_extra_config": {
                "prefill": {"dp_size": 2, "tp_size": 8},
                "decode": {"dp_size": 4, "tp_size": 4},
            },
        }
    )


def prefill_argv(port: int, kv_port: int, rank: int = 0) -> list[str]:
    """a3-pd prefill: one DP rank of a DP2 x TP8 group, external DP."""
    return [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--data-parallel-size",
        "2",
        "--data-parallel-rank",
        str(rank),
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        "12321",
        "--tensor-parallel-size",
        "8",
        "--enable-expert-parallel",
        "--seed",
        "1024",
        "--quantization",
        "ascend",
        "--served-model-name",
        MODEL,
        "--trust-remote-code",
        "--max-model-len",
        "32768",
        "--no-enable-prefix-caching",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "16384",
        "--gpu-memory-utilization",
        "0.8",
        "--enforce-eager",
        "--additional-config",
        '{"enable_flashcomm1":true}',
        "--kv-transfer-config",
        kv_config("kv_producer", kv_port, "prefill-0"),
    ]


def decode_argv(port: int, kv_port: int, rank: int = 0) -> list[str]:
    """a3-pd decode: one DP rank of a DP4 x TP4 group."""
    return [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--data-parallel-size",
        "4",
        "--data-parallel-rank",
        str(rank),
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        "12321",
        "--tensor-parallel-size",
        "4",
        "--enable-expert-parallel",
        "--seed",
        "1024",
        "--quantization",
        "ascend",
        "--served-model-name",
        MODEL,
        "--trust-remote-code",
        "--max-model-len",
        "32768",
        "--no-enable-prefix-caching",
        "--max-num-seqs",
        "48",
        "--max-num-batched-tokens",
        "256",
        "--gpu-memory-utilization",
        "0.95",
        "--compilation-config",
        '{"cudagraph_mode":"FULL_DECODE_ONLY"}',
        "--additional-config",
        '{"recompute_scheduler_enable":true,"multistream_overlap_shared_expert":false}',
        "--kv-transfer-config",
        kv_config("kv_consumer", kv_port, "decode-0"),
    ]


def colocated_argv(port: int) -> list[str]:
    return [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tensor-parallel-size",
        "4",
        "--served-model-name",
        MODEL,
        "--max-model-len",
        "4096",
        "--quantization",
        "ascend",
    ]


@dataclass
class Sim:
    """One simulator subprocess and its log files."""

    proc: subprocess.Popen
    port: int
    out: Path
    err: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"sim exited {self.proc.returncode} before ready:\n{self.logs()}")
            try:
                if http("GET", f"{self.url}/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"sim not ready in {STARTUP_TIMEOUT}s:\n{self.logs()}")

    def wait_exit(self, timeout: float = STARTUP_TIMEOUT) -> int:
        return self.proc.wait(timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Sample values summed per name (finished_reason kept apart as name{reason})."""
        text = http("GET", f"{self.url}/metrics")[1].decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name
                for label in ("finished_reason", "source"):
                    if label in sample.labels:
                        key += "{" + sample.labels[label] + "}"
                out[key] = out.get(key, 0.0) + sample.value
        return out


def http(method: str, url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 30.0):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def sse_events(raw: bytes) -> list[str]:
    return [line[len("data: ") :] for line in raw.decode().splitlines() if line.startswith("data: ")]


@pytest.fixture
def simhost(tmp_path):
    """A fake host: KIMI_SIM_DIR with host.json, a tiny model dir, and a launcher that cleans up."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "host.json").write_text(
        json.dumps(
            {
                "hardware": "atlas-800-a3",
                "npus": 16,
                "chip_name": "Ascend910",
                "hbm_mb": 65536,
                "device_ips": [f"10.20.0.{i}" for i in range(16)],
                "load_gib_per_s": 2.0,
            }
        )
    )
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["KimiK25ForConditionalGeneration"],
                "text_config": {
                    "kv_lora_rank": 512,
                    "qk_rope_head_dim": 64,
                    "num_hidden_layers": 61,
                    "max_position_embeddings": 262144,
                },
            }
        )
    )
    (model / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 65536)
    host = SimHost(tmp_path, state, model)
    yield host
    host.stop_all()


class SimHost:
    """Starts simulator subprocesses for one fake host."""

    def __init__(self, root: Path, state: Path, model: Path) -> None:
        self.root, self.state, self.model = root, state, model
        self.sims: list[Sim] = []
        self.others: list[subprocess.Popen] = []

    def env(self, devices: str | None, **extra: str) -> dict[str, str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "KIMI_SIM_DIR": str(self.state),
            "KIMI_SIM_LOAD_SECONDS": "0",
            "KIMI_SIM_TPOT_S": "0.001",
            "KIMI_SIM_PREFILL_TOKENS_PER_S": "1000000",
        }
        if devices is not None:
            env["ASCEND_RT_VISIBLE_DEVICES"] = devices
        env.update(extra)
        return env

    def start(self, argv: list[str], devices: str | None = "0,1,2,3", model: str | None = None, **env: str) -> Sim:
        port = int(argv[argv.index("--port") + 1]) if "--port" in argv else 8000
        n = len(self.sims)
        out, err = self.root / f"sim{n}.out", self.root / f"sim{n}.err"
        with out.open("wb") as fout, err.open("wb") as ferr:
            proc = subprocess.Popen(
                [PYTHON, "-I", str(SIM), "serve", model or str(self.model), *argv],
                env=self.env(devices, **env),
                stdout=fout,
                stderr=ferr,
            )
        sim = Sim(proc, port, out, err)
        self.sims.append(sim)
        return sim

    def stop_all(self) -> None:
        for proc in [s.proc for s in self.sims] + self.others:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


P_DEVICES = "0,1,2,3,4,5,6,7"
D_DEVICES = "8,9,10,11"


# --- startup failures ------------------------------------------------------------------------------


def test_unknown_flag_exits_2_naming_it(simhost):
    sim = simhost.start([*colocated_argv(free_port()), "--foo", "bar"])
    assert sim.wait_exit() == 2
    assert "vllm serve: error: unrecognized arguments: --foo bar" in sim.err.read_text()


def test_bad_json_exits_nonzero_naming_the_flag(simhost):
    sim = simhost.start([*colocated_argv(free_port()), "--kv-transfer-config", '{"kv_role": kv_producer}'])
    assert sim.wait_exit() != 0
    assert "argument --kv-transfer-config: invalid JSON" in sim.err.read_text()


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (("--data-parallel-size", "4"), "prefill.dp_size (2) must equal --data-parallel-size (4)"),
        (("--tensor-parallel-size", "4"), "prefill.tp_size (8) must equal --tensor-parallel-size (4)"),
    ],
)
def test_connector_rule_violation_exits_1(simhost, change, needle):
    argv = prefill_argv(free_port(), free_port_range(8))
    argv[argv.index(change[0]) + 1] = change[1]
    sim = simhost.start(argv, devices=P_DEVICES)
    assert sim.wait_exit() == 1
    assert needle in sim.err.read_text()


def test_prefill_tp_below_decode_tp_exits_1(simhost):
    argv = decode_argv(free_port(), free_port_range(4))
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    kv["kv_connector_extra_config"]["prefill"]["tp_size"] = 2
    argv[argv.index("--kv-transfer-config") + 1] = json.dumps(kv)
    sim = simhost.start(argv, devices=D_DEVICES)
    assert sim.wait_exit() == 1
    assert "prefill tp_size (2) must be >= decode tp_size (4)" in sim.err.read_text()


def test_balance_scheduling_env_with_pd_exits_1(simhost):
    sim = simhost.start(
        prefill_argv(free_port(), free_port_range(8)), devices=P_DEVICES, VLLM_ASCEND_BALANCE_SCHEDULING="1"
    )
    assert sim.wait_exit() == 1
    assert "not supported with P/D disaggregation" in sim.err.read_text()


def test_missing_config_json_fails_like_vllm(simhost, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    sim = simhost.start(colocated_argv(free_port()), model=str(empty))
    assert sim.wait_exit() == 1
    assert "Invalid repository ID or local directory specified" in sim.err.read_text()


@pytest.mark.parametrize(
    ("devices", "needle"),
    [
        (None, "ASCEND_RT_VISIBLE_DEVICES is not set"),
        ("0,1", "has 2 NPU(s) but the engine needs 4"),
        ("14,15,16,17", "NPU(s) [16, 17] but this host has 16 NPUs"),
    ],
)
def test_visible_devices_must_match_host_and_tp(simhost, devices, needle):
    sim = simhost.start(colocated_argv(free_port()), devices=devices)
    assert sim.wait_exit() == 1
    assert needle in sim.err.read_text()


def test_live_claim_conflict_names_npu_and_holder(simhost):
    first = simhost.start(colocated_argv(free_port()), devices="0,1,2,3")
    first.wait_ready()
    second = simhost.start(colocated_argv(free_port()), devices="3,4,5,6")
    assert second.wait_exit() == 1
    assert f"NPU 3 is already in use by process {first.proc.pid}" in second.err.read_text()
    assert not (simhost.state / "claims" / "npu4").exists(), "the failed engine must not keep NPUs"
    assert (simhost.state / "claims" / "npu3").read_text().strip() == str(first.proc.pid)


def test_stale_claim_is_taken_over_and_released_on_sigterm(simhost):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    claims = simhost.state / "claims"
    claims.mkdir()
    (claims / "npu2").write_text(f"{dead.pid}\n")
    sim = simhost.start(colocated_argv(free_port()), devices="0,1,2,3")
    sim.wait_ready()
    assert (claims / "npu2").read_text().strip() == str(sim.proc.pid)
    assert "stale claim" in sim.out.read_text()
    sim.proc.send_signal(signal.SIGTERM)
    assert sim.wait_exit() == 0
    assert sorted(p.name for p in claims.glob("npu*")) == []


def test_claims_released_on_sigint(simhost):
    sim = simhost.start(colocated_argv(free_port()), devices="4,5,6,7")
    sim.wait_ready()
    assert len(list((simhost.state / "claims").glob("npu*"))) == 4
    sim.proc.send_signal(signal.SIGINT)
    assert sim.wait_exit() == 0
    assert list((simhost.state / "claims").glob("npu*")) == []


def test_missing_host_json_runs_as_16_npu_host(simhost):
    (simhost.state / "host.json").unlink()
    sim = simhost.start(colocated_argv(free_port()), devices="12,13,14,15")
    sim.wait_ready()
    assert "running as if on a 16-NPU" in sim.out.read_text()


def test_weights_that_do_not_fit_hbm_fail(simhost):
    host = json.loads((simhost.state / "host.json").read_text())
    (simhost.state / "host.json").write_text(json.dumps({**host, "hbm_mb": 2048}))
    sim = simhost.start(colocated_argv(free_port()))
    assert sim.wait_exit() == 1
    assert "No available memory for the cache blocks" in sim.err.read_text()


def test_crash_fault_exits_1_for_matching_role_only(simhost):
    (simhost.state / "faults.json").write_text(json.dumps({"engine_crash_at_start": ["decode"]}))
    crashed = simhost.start(decode_argv(free_port(), free_port_range(4)), devices=D_DEVICES)
    assert crashed.wait_exit() == 1
    assert "engine_crash_at_start for role 'decode'" in crashed.err.read_text()
    healthy = simhost.start(colocated_argv(free_port()))
    healthy.wait_ready()


def test_hang_fault_never_opens_the_port(simhost):
    (simhost.state / "faults.json").write_text(json.dumps({"engine_hang_in_load": ["*"]}))
    sim = simhost.start(colocated_argv(free_port()))
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while "Loading weights is taking longer" not in sim.out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "Loading weights is taking longer" in sim.out.read_text()
    time.sleep(0.5)  # what a ready engine would need many times over with KIMI_SIM_LOAD_SECONDS=0
    assert sim.proc.poll() is None
    with pytest.raises(OSError):
        http("GET", f"{sim.url}/health", timeout=2)
    assert "Application startup complete" not in sim.out.read_text()
    assert len(list((simhost.state / "claims").glob("npu*"))) == 4, "a hung engine still holds its NPUs"


def test_hang_now_fault_stalls_completions_of_a_running_engine_but_not_its_health(simhost):
    """engine-hang-now: an engine started before the fault keeps answering /health and /metrics while its
    completions stall; clearing the fault lets them through; an engine started after it is not hung."""
    sim = simhost.start(colocated_argv(free_port()))
    sim.wait_ready()
    body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 2}
    assert http("POST", f"{sim.url}/v1/completions", body)[0] == 200
    faults = simhost.state / "faults.json"
    faults.write_text(json.dumps({"engine_hang_since": {"colocated": time.time()}}))
    assert http("GET", f"{sim.url}/health", timeout=5)[0] == 200
    assert http("GET", f"{sim.url}/metrics", timeout=5)[0] == 200
    before = sim.metrics()
    with pytest.raises(TimeoutError):
        http("POST", f"{sim.url}/v1/completions", body, timeout=1.5)
    # a hung engine holds its requests in its running batch and makes no progress (what `kimictl heal` judges by)
    hung = sim.metrics()
    assert hung["vllm:num_requests_running"] >= 1 and before["vllm:num_requests_running"] == 0
    assert [hung[k] for k in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total")] == [
        before[k] for k in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total")]
    faults.write_text(json.dumps({"engine_hang_since": {"decode": time.time()}}))  # another role: not this one
    assert http("POST", f"{sim.url}/v1/completions", body, timeout=10)[0] == 200
    faults.write_text(json.dumps({"engine_hang_since": {"*": time.time() - 3600}}))  # before it started
    assert http("POST", f"{sim.url}/v1/completions", body, timeout=10)[0] == 200


def test_http_port_in_use_fails(simhost):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        sim = simhost.start(colocated_argv(busy.getsockname()[1]))
        assert sim.wait_exit() == 1
    assert "Address already in use" in sim.err.read_text()


def test_side_channel_port_in_use_fails_like_zmq(simhost):
    kv_port = free_port_range(8)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", kv_port + 3))
        busy.listen(1)
        sim = simhost.start(prefill_argv(free_port(), kv_port), devices=P_DEVICES)
        assert sim.wait_exit() == 1
    assert "zmq.error.ZMQError: Address already in use" in sim.err.read_text()


# --- serving ---------------------------------------------------------------------------------------


def test_colocated_endpoints_completions_and_metrics(simhost):
    sim = simhost.start(colocated_argv(free_port()))
    sim.wait_ready()
    status, body, _ = http("GET", f"{sim.url}/v1/models")
    model = json.loads(body)["data"][0]
    assert (status, model["id"], model["owned_by"], model["max_model_len"]) == (
        200,
        MODEL,
        "kimictl-engine-sim",
        4096,
    )

    status, body, _ = http(
        "POST",
        f"{sim.url}/v1/completions",
        {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 7},
    )
    result = json.loads(body)
    assert status == 200
    assert result["usage"]["completion_tokens"] == 7 and result["choices"][0]["finish_reason"] == "length"
    assert len(result["choices"][0]["text"].split()) == 7
    again = json.loads(
        http(
            "POST",
            f"{sim.url}/v1/completions",
            {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 7},
        )[1]
    )
    assert again["choices"][0]["text"] == result["choices"][0]["text"], "output is deterministic per prompt"

    status, raw, headers = http(
        "POST",
        f"{sim.url}/v1/completions",
        {
            "model": MODEL,
            "prompt": "the quick brown fox",
            "max_tokens": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = sse_events(raw)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == result["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 7

    status, raw, _ = http(
        "POST",
        f"{sim.url}/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
    )
    chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) == 3
    status, body, _ = http(
        "POST",
        f"{sim.url}/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    assert status == 200 and json.loads(body)["choices"][0]["message"]["role"] == "assistant"

    m = sim.metrics()
    assert m["vllm:request_success_total{length}"] == 5  # 3 completions, 2 chats
    assert m["vllm:generation_tokens_total"] == 7 + 7 + 7 + 3 + 3
    assert m["vllm:time_to_first_token_seconds_count"] == 5
    assert m["vllm:inter_token_latency_seconds_count"] == 6 + 6 + 6 + 2 + 2
    assert m["vllm:e2e_request_latency_seconds_count"] == 5
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


def test_request_errors(simhost):
    sim = simhost.start(colocated_argv(free_port()))
    sim.wait_ready()
    url = f"{sim.url}/v1/completions"
    status, body, _ = http("POST", url, {"model": "other", "prompt": "x"})
    assert status == 404 and "does not exist" in json.loads(body)["error"]["message"]
    status, body, _ = http("POST", url, {"model": MODEL, "prompt": "x", "max_tokens": 5000})
    assert status == 400 and "maximum context length is 4096" in json.loads(body)["error"]["message"]
    status, body, _ = http("POST", url, {"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert status == 400
    status, _, _ = http("GET", f"{sim.url}/nope")
    assert status == 404


def test_api_key_guards_v1_only(simhost):
    sim = simhost.start([*colocated_argv(free_port()), "--api-key", "sk-test"])
    sim.wait_ready()
    assert http("GET", f"{sim.url}/v1/models")[0] == 401
    assert http("GET", f"{sim.url}/v1/models", headers={"Authorization": "Bearer sk-test"})[0] == 200
    assert http("GET", f"{sim.url}/health")[0] == 200


# --- P/D ------------------------------------------------------------------------------------------


@pytest.fixture
def pd_pair(simhost):
    p_kv = free_port_range(8)
    prefill = simhost.start(prefill_argv(free_port(), p_kv), devices=P_DEVICES)
    decode = simhost.start(decode_argv(free_port(), free_port_range(4)), devices=D_DEVICES)
    prefill.wait_ready()
    decode.wait_ready()
    return prefill, decode, p_kv


PROMPT = "Kimi K2.5 on Atlas 800 A3 with prefill and decode disaggregated"


def _prefill(prefill: Sim, request_id: str) -> dict:
    status, body, _ = http(
        "POST",
        f"{prefill.url}/v1/completions",
        {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 1,
            "min_tokens": 1,
            "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        },
        headers={"X-Request-Id": request_id},
    )
    assert status == 200, body
    return json.loads(body)


def test_prefill_then_decode_by_hand_moves_both_sides(pd_pair):
    prefill, decode, p_kv = pd_pair
    p_resp = _prefill(prefill, "req-1")
    kv = p_resp["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == p_kv  # kv_port + rank 0 * tp
    assert kv["remote_request_id"] == "cmpl-req-1-0" and kv["remote_engine_id"].startswith("prefill-0-")
    assert kv["remote_engine_id"].endswith("_dp0") and kv["remote_tp_size"] == 8
    assert kv["num_prompt_blocks"] == len(kv["remote_block_ids"]) == 1
    p_metrics = prefill.metrics()
    assert p_metrics["kimi_sim:kv_transfer_held_requests"] == 1 and p_metrics["vllm:kv_cache_usage_perc"] > 0

    status, body, _ = http(
        "POST",
        f"{decode.url}/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 9, "kv_transfer_params": kv},
    )
    assert status == 200, body
    d_resp = json.loads(body)
    assert d_resp["usage"]["completion_tokens"] == 9
    assert d_resp["choices"][0]["text"].startswith(p_resp["choices"][0]["text"]), "P and D agree on token 1"

    prompt_tokens = p_resp["usage"]["prompt_tokens"]
    p_metrics, d_metrics = prefill.metrics(), decode.metrics()
    assert p_metrics["kimi_sim:kv_transfer_sent_requests_total"] == 1
    assert p_metrics["kimi_sim:kv_transfer_sent_blocks_total"] == 1
    assert p_metrics["kimi_sim:kv_transfer_held_requests"] == 0 and p_metrics["vllm:kv_cache_usage_perc"] == 0
    assert p_metrics["vllm:prompt_tokens_total"] == prompt_tokens
    assert d_metrics["kimi_sim:kv_transfer_pulled_requests_total"] == 1
    assert d_metrics["kimi_sim:kv_transfer_pulled_tokens_total"] == prompt_tokens
    assert d_metrics["vllm:external_prefix_cache_queries_total"] == prompt_tokens
    assert d_metrics["vllm:external_prefix_cache_hits_total"] == prompt_tokens
    assert d_metrics["vllm:generation_tokens_total"] == 9
    # vLLM's prompt token sources: prefill computed the prompt, decode got all of it over the KV hand-over
    by_source = "vllm:prompt_tokens_by_source_total{%s}"
    assert p_metrics[by_source % "local_compute"] == prompt_tokens
    assert p_metrics[by_source % "external_kv_transfer"] == 0
    assert d_metrics[by_source % "external_kv_transfer"] == prompt_tokens
    assert d_metrics[by_source % "local_compute"] == 0
    assert d_metrics["vllm:request_time_per_output_token_seconds_count"] == 1, "one request of 9 tokens: one TPOT"
    assert p_metrics["vllm:request_time_per_output_token_seconds_count"] == 0, "prefill answers 1 token: no TPOT"
    assert 0 < p_metrics["process_start_time_seconds"] <= time.time()

    # The KV was freed once pulled: pulling it again is an error, not a silent local prefill.
    status, body, _ = http(
        "POST",
        f"{decode.url}/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 9, "kv_transfer_params": kv},
    )
    assert status == 500 and "cmpl-req-1-0" in json.loads(body)["error"]["message"]
    assert decode.metrics()["kimi_sim:kv_transfer_failed_requests_total"] == 1


def test_decode_pull_from_unreachable_prefill_fails_naming_it(pd_pair):
    _, decode, _ = pd_pair
    dead_port = free_port()
    kv = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [0],
        "remote_engine_id": "prefill-9_dp0",
        "remote_request_id": "cmpl-x-0",
        "remote_host": "127.0.0.1",
        "remote_port": dead_port,
        "remote_tp_size": 8,
        "num_prompt_blocks": 1,
    }
    status, body, _ = http(
        "POST",
        f"{decode.url}/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": kv},
    )
    message = json.loads(body)["error"]["message"]
    assert status == 500
    assert f"prefill engine prefill-9_dp0 at 127.0.0.1:{dead_port} failed" in message
    metrics = decode.metrics()
    assert metrics["kimi_sim:kv_transfer_failed_requests_total"] == 1
    assert metrics["vllm:generation_tokens_total"] == 0


def test_roles_reject_the_wrong_side_of_the_protocol(pd_pair):
    prefill, decode, _ = pd_pair
    status, body, _ = http(
        "POST",
        f"{decode.url}/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 400 and "kv_consumer" in json.loads(body)["error"]["message"]
    status, body, _ = http(
        "POST",
        f"{prefill.url}/v1/completions",
        {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_prefill": True},
        },
    )
    assert status == 400 and "kv_producer" in json.loads(body)["error"]["message"]


def test_unpulled_kv_expires_after_abort_timeout(simhost):
    prefill = simhost.start(
        prefill_argv(free_port(), free_port_range(8)),
        devices=P_DEVICES,
        VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT="0.2",
    )
    prefill.wait_ready()
    _prefill(prefill, "req-expire")
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while prefill.metrics()["kimi_sim:kv_transfer_expired_requests_total"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    metrics = prefill.metrics()
    assert metrics["kimi_sim:kv_transfer_expired_requests_total"] == 1
    assert metrics["kimi_sim:kv_transfer_held_requests"] == 0
    assert "Releasing expired KV blocks for request cmpl-req-expire-0" in prefill.out.read_text()


def test_second_prefill_rank_uses_its_own_side_channel_port(simhost):
    p_kv = free_port_range(16)
    rank1 = simhost.start(prefill_argv(free_port(), p_kv, rank=1), devices="8,9,10,11,12,13,14,15")
    rank1.wait_ready()
    kv = _prefill(rank1, "req-r1")["kv_transfer_params"]
    assert kv["remote_port"] == p_kv + 8 and kv["remote_engine_id"].endswith("_dp1")
    families = text_string_to_metric_families(http("GET", f"{rank1.url}/metrics")[1].decode())
    # vllm: families carry the DP rank; prometheus_client's process_* families (as in real vLLM) carry no labels
    engines = {s.labels.get("engine") for f in families if f.name.startswith(("vllm:", "kimi_sim:"))
               for s in f.samples}
    assert engines == {"1"}, "an external-DP engine labels its series with its DP rank"


# --- behind the real router -----------------------------------------------------------------------

ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))


@pytest.mark.slow
def _router(simhost, prefill: Sim, decode: Sim) -> str:
    """vllm-router in P/D mode in front of one simulated prefill and decode engine; its URL once it answers."""
    if not Path(ROUTER).exists():
        require_or_skip("vllm-router not installed (pip install vllm-router)")
    port = free_port()
    log = simhost.root / "router.log"
    with log.open("wb") as out:
        router = subprocess.Popen(
            [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
             "--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    simhost.others.append(router)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert router.poll() is None, log.read_text()
        try:
            if http("GET", f"{url}/health", timeout=2)[0] == 200:
                break
        except OSError:
            time.sleep(0.2)
    return url


def test_vllm_router_pd_end_to_end(pd_pair, simhost):
    prefill, decode, _ = pd_pair
    url = _router(simhost, prefill, decode)
    status, body, _ = http("POST", f"{url}/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 6})
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 6
    status, raw, _ = http(
        "POST",
        f"{url}/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "stream": True},
    )
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert sum(1 for e in events[:-1] if json.loads(e)["choices"][0]["delta"].get("content")) == 5
    assert http("GET", f"{url}/v1/models")[0] == 200

    p_metrics, d_metrics = prefill.metrics(), decode.metrics()
    assert p_metrics["kimi_sim:kv_transfer_sent_requests_total"] == 2
    assert d_metrics["kimi_sim:kv_transfer_pulled_requests_total"] == 2
    assert d_metrics["vllm:external_prefix_cache_hits_total"] == p_metrics["vllm:prompt_tokens_total"]
    assert d_metrics["vllm:generation_tokens_total"] == 11
    assert p_metrics["vllm:generation_tokens_total"] == 2  # max_tokens=1 per prefill
    # What the router sent (it tacks on fields vLLM does not know; the sim logs them like vLLM does).
    assert "present in the request but ignored" in prefill.out.read_text()


def _sources(sim: Sim) -> dict[str, float]:
    text = http("GET", f"{sim.url}/metrics")[1].decode()
    return {s.labels["source"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "vllm:prompt_tokens_by_source" for s in f.samples if s.name.endswith("_total")}


def test_prompt_sources_and_the_pd_probe(pd_pair, simhost):
    """vLLM's prompt token sources: prefill computes the prompt, decode gets all of it over the KV hand-over;
    health.pd_probe (deploy's smoke, status's pair probe) passes on that and fails on a decode that computed."""
    prefill, decode, _ = pd_pair
    assert _sources(decode) == {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
    url = _router(simhost, prefill, decode)
    p_end, d_end = ([("127.0.0.1", int(s.url.rsplit(":", 1)[1]))] for s in (prefill, decode))
    probe = health.pd_probe(f"{url}/v1/completions", MODEL, p_end, d_end, words=40)
    assert probe.ok, probe.detail
    assert probe.external_kv_transfer == probe.prompt_tokens == probe.prefill_prompt_tokens > 40
    assert probe.local_compute == 0
    assert _sources(prefill)["local_compute"] == probe.prompt_tokens and _sources(prefill)["external_kv_transfer"] == 0
    assert _sources(decode)["external_kv_transfer"] == probe.prompt_tokens and _sources(decode)["local_compute"] == 0

    # Straight to decode (no proxy, no kv_transfer_params): decode computes the prompt itself - a fallback.
    bad = health.pd_probe(f"{decode.url}/v1/completions", MODEL, p_end, d_end, words=40)
    assert bad.code == 200 and not bad.ok
    assert bad.local_compute == bad.prompt_tokens and bad.external_kv_transfer == 0
    assert "decode recomputed the prompt" in bad.detail


def test_vllm_host_ip_is_advertised_and_bound(simhost):
    kv_port = free_port_range(8)
    prefill = simhost.start(prefill_argv(free_port(), kv_port), devices=P_DEVICES, VLLM_HOST_IP="127.0.0.2")
    prefill.wait_ready()
    kv = _prefill(prefill, "req-ip")["kv_transfer_params"]
    assert (kv["remote_host"], kv["remote_port"]) == ("127.0.0.2", kv_port)
    status, body, _ = http("GET", f"http://127.0.0.2:{kv_port}/metadata")
    assert status == 200 and json.loads(body)["engine_id"] == kv["remote_engine_id"]


def test_non_local_vllm_host_ip_fails_the_side_channel_bind(simhost):
    sim = simhost.start(prefill_argv(free_port(), free_port_range(8)), devices=P_DEVICES, VLLM_HOST_IP="192.0.2.77")
    assert sim.wait_exit() == 1
    assert "zmq.error.ZMQError: Cannot assign requested address (addr='tcp://192.0.2.77:" in sim.err.read_text()


def test_internal_dp_serves_several_engines_and_honours_the_rank_header(simhost):
    argv = ["--host", "127.0.0.1", "--port", str(free_port()), "--data-parallel-size", "4"]
    argv += ["--tensor-parallel-size", "4", "--served-model-name", MODEL, "--max-model-len", "4096"]
    sim = simhost.start(argv, devices=",".join(map(str, range(16))))
    sim.wait_ready()
    for _ in range(4):
        assert http("POST", f"{sim.url}/v1/completions", {"prompt": "round robin", "max_tokens": 2})[0] == 200
    status, _, _ = http(
        "POST",
        f"{sim.url}/v1/completions",
        {"prompt": "pinned", "max_tokens": 2},
        {"X-data-parallel-rank": "3"},
    )
    assert status == 200
    families = text_string_to_metric_families(http("GET", f"{sim.url}/metrics")[1].decode())
    per_engine = {
        s.labels["engine"]: s.value for f in families if f.name == "vllm:generation_tokens" for s in f.samples
    }
    assert per_engine == {"0": 2.0, "1": 2.0, "2": 2.0, "3": 4.0}
    assert http("POST", f"{sim.url}/v1/completions", {"prompt": "x"}, {"X-data-parallel-rank": "7"})[0] == 400


def test_headless_engine_claims_npus_without_an_api_server(simhost):
    port = free_port()
    argv = ["--port", str(port), "--data-parallel-size", "2", "--data-parallel-size-local", "1", "--headless"]
    argv += ["--data-parallel-start-rank", "1", "--data-parallel-address", "127.0.0.1", "-tp", "8"]
    sim = simhost.start(argv, devices=P_DEVICES)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while "Headless mode" not in sim.out.read_text() and time.monotonic() < deadline:
        assert sim.proc.poll() is None, sim.logs()
        time.sleep(0.05)
    assert "Headless mode: engine(s) [1]" in sim.out.read_text()
    assert len(list((simhost.state / "claims").glob("npu*"))) == 8
    with pytest.raises(OSError):
        http("GET", f"{sim.url}/health", timeout=2)


def test_requests_beyond_max_num_seqs_wait(simhost):
    argv = [*colocated_argv(free_port()), "--max-num-seqs", "1"]
    sim = simhost.start(argv, KIMI_SIM_TPOT_S="0.05")
    sim.wait_ready()
    results: list[int] = []
    body = {"prompt": "slow one", "max_tokens": 20, "ignore_eos": True}
    threads = [
        threading.Thread(target=lambda: results.append(http("POST", f"{sim.url}/v1/completions", body)[0]))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    seen_waiting = False
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while len(results) < 2 and time.monotonic() < deadline:
        m = sim.metrics()
        assert m["vllm:num_requests_running"] <= 1
        seen_waiting |= m["vllm:num_requests_waiting"] == 1
        time.sleep(0.02)
    for thread in threads:
        thread.join()
    assert results == [200, 200] and seen_waiting


def test_disable_log_stats_drops_vllm_metrics_and_stats_lines_are_logged(simhost):
    quiet = simhost.start([*colocated_argv(free_port()), "--disable-log-stats"], devices="0,1,2,3")
    loud = simhost.start(colocated_argv(free_port()), devices="4,5,6,7", VLLM_LOG_STATS_INTERVAL="0.1")
    quiet.wait_ready()
    loud.wait_ready()
    assert not any(name.startswith("vllm:") for name in quiet.metrics())
    assert http("POST", f"{loud.url}/v1/completions", {"prompt": "stats please", "max_tokens": 3})[0] == 200
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while "Engine 000: Avg prompt throughput" not in loud.out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "Engine 000: Avg prompt throughput" in loud.out.read_text()


def test_unhealthy_npu_fails_device_init(simhost):
    (simhost.state / "faults.json").write_text(json.dumps({"npu_unhealthy": [2]}))
    sim = simhost.start(colocated_argv(free_port()), devices="0,1,2,3")
    assert sim.wait_exit() == 1
    assert "device init failed on NPU(s) [2]" in sim.err.read_text()
    assert list((simhost.state / "claims").glob("npu*")) == []


def test_link_down_on_prefill_npu_fails_the_transfer_until_cleared(pd_pair, simhost):
    prefill, decode, _ = pd_pair
    kv = _prefill(prefill, "req-link")["kv_transfer_params"]
    (simhost.state / "faults.json").write_text(json.dumps({"link_down": [5]}))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "kv_transfer_params": kv}
    status, raw, _ = http("POST", f"{decode.url}/v1/completions", body)
    assert status == 500 and "device link down on prefill NPU(s) [5]" in json.loads(raw)["error"]["message"]
    (simhost.state / "faults.json").write_text("{}")
    assert http("POST", f"{decode.url}/v1/completions", body)[0] == 200


def test_rendered_a3_pd_argv_runs_and_moves_kv_both_sides(simhost, tmp_path):
    """Start the sim with the exact argv/env `kimictl render` produces for a3-pd (ports and kv_ports made free)."""
    import yaml

    from kimictl.inventory import load_inventory
    from kimictl.plan import make_plan
    from kimictl.render import render
    from kimictl.topology import load_topology

    inv_path = tmp_path / "inv.yml"
    inv_path.write_text(yaml.safe_dump({"all": {
        "vars": {"kimi_cluster": "simtest", "kimi_model_dir": "/m", "kimi_nic": "lo", "kimi_runtime": "host",
                 "kimi_proxy_script": "/opt/vllm-ascend/proxy.py"},
        "hosts": {"p": {"ansible_host": "127.0.0.1", "kimi_hardware": "atlas-800-a3"},
                  "d": {"ansible_host": "127.0.0.2", "kimi_hardware": "atlas-800-a3"}}}}))
    inv, topo = load_inventory(inv_path), load_topology("a3-pd")
    engines = {e.id: e for e in render(make_plan(inv, topo), inv, topo).engines}

    def launch(engine_id: str, kv_width: int) -> tuple[Sim, int]:
        e = engines[engine_id]
        argv = list(e.argv[3:])  # after `vllm serve MODEL`
        assert argv[argv.index("--host") + 1] == e.host_ip  # engines listen on their host's business IP
        argv[argv.index("--host") + 1] = "127.0.0.1"  # this one fake host answers on loopback
        argv[argv.index("--port") + 1] = str(free_port())
        i = argv.index("--kv-transfer-config") + 1
        kv = json.loads(argv[i])
        kv["kv_port"] = str(free_port_range(kv_width))
        argv[i] = json.dumps(kv)
        env = {k: v for k, v in e.env.items() if k != "ASCEND_RT_VISIBLE_DEVICES"}
        return simhost.start(argv, devices=e.env["ASCEND_RT_VISIBLE_DEVICES"], **env), int(kv["kv_port"])

    prefill, p_kv = launch("prefill-0-dp0", 16)
    decode, _ = launch("decode-0-dp2", 16)  # NPUs 8-11: prefill-0-dp0 holds 0-7 on this one sim host
    prefill.wait_ready()
    decode.wait_ready()
    kv = _prefill(prefill, "rendered-1")["kv_transfer_params"]
    assert kv["remote_host"] == engines["prefill-0-dp0"].host_ip and kv["remote_port"] == p_kv
    status, body, _ = http("POST", f"{decode.url}/v1/completions",
                           {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": kv})
    assert status == 200, body
    assert prefill.metrics()["vllm:prompt_tokens_total"] > 0
    assert decode.metrics()["vllm:external_prefix_cache_queries_total"] > 0

    # the same rendered argv with one corrupted flag is refused, naming the flag
    bad = [*engines["decode-0-dp1"].argv[3:], "--max-num-seqz", "8"]
    proc = subprocess.run([PYTHON, "-I", str(SIM), "serve", str(simhost.model), *bad], capture_output=True,
                          text=True, env=simhost.env("4,5,6,7"), timeout=60, check=False)
    assert proc.returncode != 0 and "--max-num-seqz" in proc.stderr
