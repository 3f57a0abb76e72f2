"""In-process tests of the engine simulator's argv parsing and vLLM-Ascend startup rules."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kimictl.sandbox import engine_sim as es

KV_P = {
    "kv_connector": "MooncakeConnectorV1",
    "kv_role": "kv_producer",
    "kv_port": "36000",
    "engine_id": "prefill-0",
    "kv_connector_extra_config": {
        "prefill": {"dp_size": 2, "tp_size": 8},
        "decode": {"dp_size": 4, "tp_size": 4},
    },
}


def _args(*extra: str, kv: dict | None = None, tp: int = 8, dp: int = 2):
    argv = ["serve", "/m", "--tensor-parallel-size", str(tp), "--data-parallel-size", str(dp)]
    argv += ["--data-parallel-rank", "0", *extra]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    return es.parse_cli(argv)


def _kv(**changes) -> dict:
    kv = json.loads(json.dumps(KV_P))
    for key, value in changes.items():
        if key in ("prefill", "decode"):
            kv["kv_connector_extra_config"][key] = value
        else:
            kv[key] = value
    return kv


def test_every_table_flag_is_accepted_and_underscores_normalise():
    args = es.parse_cli(["serve", "/m", "--max_model_len", "32k", "--no-enable-prefix-caching", "-tp", "4"])
    assert args.max_model_len == 32000
    assert args.enable_prefix_caching is False
    assert args.tensor_parallel_size == 4
    assert {names[0] for names, _ in es.SERVE_FLAGS} >= {
        "--host",
        "--port",
        "--data-parallel-size",
        "--data-parallel-rank",
        "--data-parallel-address",
        "--data-parallel-rpc-port",
        "--data-parallel-size-local",
        "--data-parallel-start-rank",
        "--headless",
        "--api-server-count",
        "--tensor-parallel-size",
        "--enable-expert-parallel",
        "--seed",
        "--quantization",
        "--served-model-name",
        "--trust-remote-code",
        "--max-model-len",
        "--enable-prefix-caching",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--gpu-memory-utilization",
        "--enforce-eager",
        "--speculative-config",
        "--mm-encoder-tp-mode",
        "--compilation-config",
        "--additional-config",
        "--kv-transfer-config",
        "--tool-call-parser",
        "--reasoning-parser",
        "--enable-auto-tool-choice",
        "--allowed-local-media-path",
        "--async-scheduling",
        "--mm-processor-cache-type",
        "--mm-processor-cache-gb",
        "--api-key",
        "--distributed-executor-backend",
        "--safetensors-load-strategy",
        "--block-size",
        "--dtype",
        "--uvicorn-log-level",
        "--disable-log-stats",
        "--enable-log-requests",
    }


def test_unknown_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        es.parse_cli(["serve", "/m", "--foo", "1"])
    assert exc.value.code == 2
    assert "vllm serve: error: unrecognized arguments: --foo" in capsys.readouterr().err


def test_not_serve_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        es.parse_cli(["server", "/m"])
    assert exc.value.code == 2
    assert "invalid choice: 'server'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag", ["--kv-transfer-config", "--additional-config", "--compilation-config", "--speculative-config"]
)
def test_bad_json_names_the_flag(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        es.parse_cli(["serve", "/m", flag, "{not json"])
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_bad_quantization_choice(capsys):
    with pytest.raises(SystemExit):
        es.parse_cli(["serve", "/m", "--quantization", "w4a8"])
    err = capsys.readouterr().err
    assert "--quantization" in err and "invalid choice: 'w4a8'" in err and "'ascend'" in err


def test_valid_producer_and_consumer_configs_pass():
    cfg = es.check_engine_config(_args(kv=KV_P), {})
    assert (cfg.role, cfg.kv_port, cfg.dp_ranks, cfg.engine_id_base) == ("prefill", 36000, [0], "prefill-0")
    consumer = _kv(kv_role="kv_consumer", kv_port="36200")
    cfg = es.check_engine_config(_args(kv=consumer, tp=4, dp=4), {})
    assert cfg.role == "decode"
    assert es.check_engine_config(_args(), {}).role == "colocated"


@pytest.mark.parametrize(
    ("kv", "tp", "dp", "needle"),
    [
        (_kv(), 8, 4, "prefill.dp_size (2) must equal --data-parallel-size (4)"),
        (_kv(), 4, 2, "prefill.tp_size (8) must equal --tensor-parallel-size (4)"),
        (_kv(kv_role="kv_consumer"), 4, 2, "decode.dp_size (4) must equal --data-parallel-size (2)"),
        (_kv(kv_role="kv_consumer"), 8, 4, "decode.tp_size (4) must equal --tensor-parallel-size (8)"),
        (
            _kv(prefill={"dp_size": 2, "tp_size": 2}),
            2,
            2,
            "prefill tp_size (2) must be >= decode tp_size (4)",
        ),
        (_kv(decode={"tp_size": 4}), 8, 2, "kv_connector_extra_config.decode.dp_size is required"),
        (_kv(prefill=None), 8, 2, "kv_connector_extra_config.prefill is required"),
        (_kv(kv_role="kv_sender"), 8, 2, "unsupported kv_role 'kv_sender'"),
        (_kv(kv_connector="MooncakeConnector"), 8, 2, "upstream vLLM's GPU connector"),
        (_kv(kv_connector="FooConnector"), 8, 2, "unknown kv_connector 'FooConnector'"),
        (_kv(kv_ports="1"), 8, 2, "unexpected keyword(s) ['kv_ports']"),
    ],
)
def test_connector_rules(kv, tp, dp, needle):
    with pytest.raises(es.SimError) as exc:
        es.check_engine_config(_args(kv=kv, tp=tp, dp=dp), {})
    assert needle in str(exc.value)


def test_balance_scheduling_is_rejected_under_pd_but_not_colocated():
    with pytest.raises(es.SimError, match="balance scheduling"):
        es.check_engine_config(_args(kv=KV_P), {"VLLM_ASCEND_BALANCE_SCHEDULING": "1"})
    with pytest.raises(es.SimError, match="balance scheduling"):
        es.check_engine_config(_args("--additional-config", '{"enable_balance_scheduling": true}', kv=KV_P), {})
    assert es.check_engine_config(_args(), {"VLLM_ASCEND_BALANCE_SCHEDULING": "1"}).role == "colocated"


def test_recompute_scheduler_forced_off_on_producer_and_removed_keys_warn(caplog):
    extra = '{"recompute_scheduler_enable": true, "torchair_graph_config": {"enabled": false}}'
    with caplog.at_level(logging.WARNING, logger=es.log.name):
        es.log.propagate = True
        try:
            cfg = es.check_engine_config(_args("--additional-config", extra, kv=KV_P), {})
        finally:
            es.log.propagate = False
    assert cfg.additional["recompute_scheduler_enable"] is False
    text = caplog.text
    assert "forcing it off" in text
    assert "'torchair_graph_config' was removed" in text and "ignored" in text


def test_recompute_scheduler_in_mixed_mode_is_an_error():
    with pytest.raises(es.SimError, match="recompute_scheduler_enable"):
        es.check_engine_config(_args("--additional-config", '{"recompute_scheduler_enable": true}'), {})


def test_bad_cudagraph_mode_and_dp_rank():
    with pytest.raises(es.SimError, match="cudagraph_mode"):
        es.check_engine_config(_args("--compilation-config", '{"cudagraph_mode": "FULL_DECODE"}'), {})
    with pytest.raises(es.SimError, match=r"data_parallel_rank \(2\)"):
        es.check_engine_config(es.parse_cli(["serve", "/m", "-dp", "2", "--data-parallel-rank", "2"]), {})


def test_visible_devices_rules():
    assert es.parse_visible_devices({"ASCEND_RT_VISIBLE_DEVICES": "8,9,10,11"}, 16, 4) == [8, 9, 10, 11]
    for env, needle in (
        ({}, "not set"),
        ({"ASCEND_RT_VISIBLE_DEVICES": "0,1"}, "needs 4"),
        ({"ASCEND_RT_VISIBLE_DEVICES": "6,7,8,9"}, "NPU(s) [8, 9]"),
        ({"ASCEND_RT_VISIBLE_DEVICES": "0,0,1,2"}, "twice"),
    ):
        with pytest.raises(es.SimError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            es.parse_visible_devices(env, 8, 4)


def test_claims_conflict_takeover_and_release(tmp_path):
    claims = es.NpuClaims(tmp_path)
    claims_dir = tmp_path / "claims"
    claims_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (claims_dir / "npu3").write_text(f"{holder.pid}\n")
        with pytest.raises(es.SimError) as exc:
            claims.claim([2, 3])
        assert f"NPU 3 is already in use by process {holder.pid}" in str(exc.value)
        assert not (claims_dir / "npu2").exists(), "a failed claim must not keep the NPUs it got"
    finally:
        holder.kill()
        holder.wait()
    claims.claim([2, 3])  # the holder is gone: its claim is stale
    assert (claims_dir / "npu3").read_text().strip() == str(os.getpid())
    claims.release()
    assert not (claims_dir / "npu2").exists() and not (claims_dir / "npu3").exists()


def test_metrics_render_parses_with_prometheus_client():
    metrics = es.Metrics()
    key = ("kimi-k2.5", "1")
    metrics.register_engine(key)
    metrics.ttft.observe(key, 0.03)
    metrics.prompt_tokens.inc(key, 7)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render())}
    assert families["vllm:prompt_tokens"].type == "counter"
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    buckets = {
        s.labels["le"]: s.value
        for s in families["vllm:time_to_first_token_seconds"].samples
        if s.name.endswith("_bucket")
    }
    assert (buckets["0.02"], buckets["0.04"], buckets["+Inf"]) == (0.0, 1.0, 1.0)
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}


def test_tokenizer_and_output_are_deterministic():
    ids = es.tokenize("hello world, prefill")
    assert ids == es.tokenize("hello world, prefill") and len(ids) == 6  # 2 + 2 + 2 four-char pieces
    pieces, reason = es.plan_output(ids, 5, 0, False)
    assert len(pieces) == 5 and reason == "length"
    assert es.plan_output(ids, 5, 0, False) == (pieces, reason)
    long_pieces, long_reason = es.plan_output(ids, 10_000, 0, False)
    assert long_reason == "stop" and long_pieces[:5] == pieces


def test_sim_file_imports_nothing_outside_the_stdlib():
    source = Path(es.__file__).read_text()
    imported = {
        line.split()[1].split(".")[0]
        for line in source.splitlines()
        if line.startswith(("import ", "from ")) and not line.startswith("from __future__")
    }
    assert imported <= set(sys.stdlib_module_names)
