#!/usr/bin/python3
"""Simulated vLLM-Ascend `vllm serve` for the kimictl sandbox (stdlib only; run as /opt/kimi-sim/bin/vllm)."""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import logging
import math
import os
import random
import re
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import zlib
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# The versions this simulator impersonates (v0.23.0.post1 pairs with vLLM v0.23.0:
# https://github.com/vllm-project/vllm-ascend/blob/releases/v0.23.0/docs/source/community/versioning_policy.md).
VLLM_VERSION = "0.23.0"
VLLM_ASCEND_VERSION = "0.23.0.post1"
OWNED_BY = "kimictl-engine-sim"

log = logging.getLogger("vllm.entrypoints.openai.api_server")
access_log = logging.getLogger("uvicorn.access")


class SimError(Exception):
    """A startup failure: logged as an ERROR and turned into a non-zero exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------------------------------
# Argument parsing: the accepted `vllm serve` surface, one table.
# --------------------------------------------------------------------------------------------------

QUANTIZATION_METHODS = (
    "aqlm", "awq", "deepspeedfp", "tpu_int8", "fp8", "ptpc_fp8", "fbgemm_fp8", "modelopt", "modelopt_fp4",
    "bitblas", "gguf", "gptq_marlin", "gptq_bitblas", "awq_marlin", "gptq", "compressed-tensors",
    "bitsandbytes", "hqq", "experts_int8", "ipex", "quark", "moe_wna16", "torchao", "auto-round", "rtn",
    "inc", "mxfp4", "petit_nvfp4", "ascend",
)  # fmt: skip
JSON_FLAGS = ("kv_transfer_config", "additional_config", "compilation_config", "speculative_config")


def _json_object(text: str) -> dict[str, Any]:
    """argparse type for JSON-valued flags (vLLM parses them into config objects)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON ({exc.msg} at char {exc.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}: {text!r}")
    return value


def _human_int(text: str) -> int:
    """vLLM accepts max-model-len as 32768, 32k or 1m."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"invalid integer value: {text!r}")
    scale = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3}[match.group(2).lower()]
    if match.group(2).isupper():
        scale = {"K": 1024, "M": 1024**2, "G": 1024**3}[match.group(2)]
    return int(float(match.group(1)) * scale)


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {value}")
    return value


BOOL_OPT = argparse.BooleanOptionalAction
SERVE_FLAGS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("--model",), {"type": str}),
    (("--host",), {"type": str}),
    (("--port",), {"type": _port, "default": 8000}),
    (("--headless",), {"action": "store_true"}),
    (("--api-server-count", "-asc"), {"type": int, "default": 1}),
    (("--api-key",), {"type": str}),
    (("--uvicorn-log-level",), {"choices": ("debug", "info", "warning", "error", "critical", "trace"),
                                "default": "info"}),
    (("--disable-uvicorn-access-log",), {"action": "store_true"}),
    (("--enable-request-id-headers",), {"action": "store_true"}),
    (("--disable-log-stats",), {"action": "store_true"}),
    (("--enable-log-requests",), {"action": BOOL_OPT, "default": False}),
    (("--served-model-name",), {"nargs": "+", "type": str}),
    (("--tokenizer",), {"type": str}),
    (("--revision",), {"type": str}),
    (("--trust-remote-code",), {"action": BOOL_OPT, "default": False}),
    (("--dtype",), {"choices": ("auto", "half", "float16", "bfloat16", "float", "float32")}),
    (("--seed",), {"type": int}),
    (("--quantization", "-q"), {"choices": QUANTIZATION_METHODS}),
    (("--load-format",), {"type": str, "default": "auto"}),
    (("--safetensors-load-strategy",), {"choices": ("lazy", "eager", "prefetch"), "default": "lazy"}),
    (("--max-model-len",), {"type": _human_int}),
    (("--block-size",), {"type": int}),
    (("--kv-cache-dtype",), {"type": str, "default": "auto"}),
    (("--gpu-memory-utilization",), {"type": float, "default": 0.9}),
    (("--enable-prefix-caching",), {"action": BOOL_OPT}),
    (("--enable-chunked-prefill",), {"action": BOOL_OPT}),
    (("--max-num-seqs",), {"type": int}),
    (("--max-num-batched-tokens",), {"type": int}),
    (("--async-scheduling",), {"action": BOOL_OPT}),
    (("--enforce-eager",), {"action": BOOL_OPT, "default": False}),
    (("--tensor-parallel-size", "-tp"), {"type": int, "default": 1}),
    (("--pipeline-parallel-size", "-pp"), {"type": int, "default": 1}),
    (("--data-parallel-size", "-dp"), {"type": int, "default": 1}),
    (("--data-parallel-rank", "-dpn"), {"type": int}),
    (("--data-parallel-start-rank", "-dpr"), {"type": int}),
    (("--data-parallel-size-local", "-dpl"), {"type": int}),
    (("--data-parallel-address", "-dpa"), {"type": str}),
    (("--data-parallel-rpc-port", "-dpp"), {"type": _port}),
    (("--data-parallel-backend", "-dpb"), {"choices": ("mp", "ray"), "default": "mp"}),
    (("--enable-expert-parallel", "-ep"), {"action": BOOL_OPT, "default": False}),
    (("--enable-eplb",), {"action": BOOL_OPT, "default": False}),
    (("--distributed-executor-backend",), {"choices": ("ray", "mp", "uni", "external_launcher")}),
    (("--speculative-config",), {"type": _json_object}),
    (("--compilation-config", "-O"), {"type": _json_object}),
    (("--additional-config",), {"type": _json_object}),
    (("--kv-transfer-config",), {"type": _json_object}),
    (("--mm-encoder-tp-mode",), {"choices": ("weights", "data"), "default": "weights"}),
    (("--mm-processor-cache-type",), {"choices": ("lru", "shm"), "default": "lru"}),
    (("--mm-processor-cache-gb",), {"type": float, "default": 4.0}),
    (("--allowed-local-media-path",), {"type": str, "default": ""}),
    (("--tool-call-parser",), {"type": str}),
    (("--reasoning-parser",), {"type": str}),
    (("--enable-auto-tool-choice",), {"action": "store_true"}),
    (("--chat-template",), {"type": str}),
    (("--generation-config",), {"type": str, "default": "auto"}),
)  # fmt: skip


class _VllmArgumentParser(argparse.ArgumentParser):
    """Like vLLM's FlexibleArgumentParser: `--max_model_len` means `--max-model-len`."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        normalized = []
        for arg in sys.argv[1:] if args is None else args:
            if arg.startswith("--") and len(arg) > 2:
                name, eq, value = arg.partition("=")
                normalized.append(name.replace("_", "-") + eq + value)
            else:
                normalized.append(arg)
        return super().parse_args(normalized, namespace)


def build_parser() -> argparse.ArgumentParser:
    """The `vllm serve` parser, built from SERVE_FLAGS."""
    parser = _VllmArgumentParser(
        prog="vllm serve", description="Start the vLLM OpenAI compatible API server.", allow_abbrev=False
    )
    parser.add_argument("model_tag", nargs="?", help="model path (a local directory for this simulator)")
    for names, kwargs in SERVE_FLAGS:
        parser.add_argument(*names, **kwargs)
    return parser


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """Parse `vllm ...` argv (without the program name); exits 2 on usage errors like vLLM."""
    if argv[:1] in (["--version"], ["-v"]):
        print(VLLM_VERSION)
        raise SystemExit(0)
    if not argv or argv[0] != "serve":
        got = repr(argv[0]) if argv else "nothing"
        print("usage: vllm [-h] [-v] {chat,complete,serve,bench,collect-env,run-batch} ...", file=sys.stderr)
        print(
            f"vllm: error: argument subparser: invalid choice: {got} (this simulator implements 'serve')",
            file=sys.stderr,
        )
        raise SystemExit(2)
    parser = build_parser()
    args = parser.parse_args(argv[1:])
    args.model = args.model_tag or args.model
    if not args.model:
        parser.error("the following arguments are required: model_tag (or --model)")
    return args


# --------------------------------------------------------------------------------------------------
# Configuration rules vLLM / vLLM-Ascend enforce at startup (vllm_ascend/ascend_config.py and the Mooncake
# connector's checks: https://github.com/vllm-project/vllm-ascend/blob/releases/v0.23.0).
# --------------------------------------------------------------------------------------------------

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_TRANSFER_FIELDS = (
    "kv_connector", "engine_id", "kv_buffer_device", "kv_buffer_size", "kv_role", "kv_rank",
    "kv_parallel_size", "kv_ip", "kv_port", "kv_connector_extra_config", "kv_connector_module_path",
    "enable_permute_local_kv", "kv_load_failure_policy",
)  # fmt: skip
SIMULATED_CONNECTORS = ("MooncakeConnectorV1", "MooncakeLayerwiseConnector")
OTHER_ASCEND_CONNECTORS = (
    "MooncakeHybridConnector", "MooncakeConnectorStoreV1", "AscendStoreConnector", "MultiConnector",
    "UCMConnector", "LMCacheAscendConnector", "SimpleCPUOffloadConnector", "RecomputeCPUOffloadConnector",
)  # fmt: skip
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
REMOVED_ADDITIONAL_KEYS = ("torchair_graph_config", "ascend_scheduler_config")  # removed in v0.12.0rc1
ROLE_OF_KV_ROLE = {
    "kv_producer": "prefill",
    "kv_consumer": "decode",
    "kv_both": "colocated",
    None: "colocated",
}


@dataclass
class EngineConfig:
    """Everything the simulated engine derived from argv and env at startup."""

    args: argparse.Namespace
    kv: dict[str, Any] | None
    kv_role: str | None
    role: str
    engine_id_base: str
    kv_port: int | None
    additional: dict[str, Any]
    dp_ranks: list[int]
    tp: int
    pp: int


def _flag_true(value: Any) -> bool:
    return value is True or str(value).lower() in ("1", "true", "yes")


def check_engine_config(args: argparse.Namespace, env: dict[str, str]) -> EngineConfig:
    """Apply the startup checks vLLM and vLLM-Ascend make on the parsed flags; raise SimError."""
    tp, pp, dp = args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size
    for flag, value in (
        ("--tensor-parallel-size", tp),
        ("--pipeline-parallel-size", pp),
        ("--data-parallel-size", dp),
    ):
        if value < 1:
            raise SimError(f"{flag} must be >= 1, got {value}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise SimError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.data_parallel_rank is not None:
        # External-DP launch: one engine per process; vLLM forces size_local to 1.
        if not 0 <= args.data_parallel_rank < dp:
            raise SimError(f"data_parallel_rank ({args.data_parallel_rank}) must be in [0, data_parallel_size={dp})")
        dp_ranks = [args.data_parallel_rank]
    else:
        start = args.data_parallel_start_rank or 0
        local = args.data_parallel_size_local if args.data_parallel_size_local is not None else dp
        if args.headless and args.data_parallel_start_rank is None and dp > 1:
            log.warning("--headless without --data-parallel-start-rank: assuming start rank 0")
        if local < 1 or start + local > dp:
            raise SimError(f"data parallel ranks {start}..{start + local - 1} fall outside data_parallel_size={dp}")
        dp_ranks = list(range(start, start + local))

    compilation = args.compilation_config or {}
    mode = compilation.get("cudagraph_mode")
    if mode is not None and str(mode).upper() not in CUDAGRAPH_MODES:
        raise SimError(
            f"--compilation-config: invalid cudagraph_mode {mode!r}; expected one of {', '.join(CUDAGRAPH_MODES)}"
        )

    kv = args.kv_transfer_config
    kv_role = None
    kv_port = None
    engine_id_base = str(uuid.uuid4())
    if kv is not None:
        unknown = sorted(set(kv) - set(KV_TRANSFER_FIELDS))
        if unknown:
            raise SimError(
                f"--kv-transfer-config: unexpected keyword(s) {unknown} for KVTransferConfig; "
                f"valid keys: {', '.join(KV_TRANSFER_FIELDS)}"
            )
        kv_role = kv.get("kv_role")
        connector = kv.get("kv_connector")
        if connector is not None and kv_role not in KV_ROLES:
            raise SimError(
                f"--kv-transfer-config: unsupported kv_role {kv_role!r}; supported roles are {list(KV_ROLES)}"
            )
        if kv_role is not None and not connector:
            raise SimError("--kv-transfer-config: please specify kv_connector when kv_role is set")
        if connector == "MooncakeConnector":
            raise SimError(
                "--kv-transfer-config: 'MooncakeConnector' is upstream vLLM's GPU connector and "
                "cannot run on Ascend; use 'MooncakeConnectorV1' (vllm-ascend)"
            )
        if connector in OTHER_ASCEND_CONNECTORS:
            raise SimError(
                f"--kv-transfer-config: kv_connector {connector!r} is registered by vllm-ascend but "
                f"not simulated by {OWNED_BY}; simulated: {', '.join(SIMULATED_CONNECTORS)}"
            )
        if connector and connector not in SIMULATED_CONNECTORS:
            raise SimError(
                f"--kv-transfer-config: unknown kv_connector {connector!r}; vllm-ascend registers "
                f"{', '.join(SIMULATED_CONNECTORS + OTHER_ASCEND_CONNECTORS)}"
            )
        if connector:
            _check_mooncake_config(kv, kv_role, tp, dp)
            try:
                kv_port = int(kv.get("kv_port", 30000))  # docs write it as a string; the connector int()s it
            except (TypeError, ValueError):
                raise SimError(f"--kv-transfer-config: kv_port must be an integer, got {kv.get('kv_port')!r}") from None
        if kv.get("engine_id") not in (None, ""):
            engine_id_base = str(kv["engine_id"])
        if kv.get("kv_connector_module_path"):
            log.info(
                "kv_connector %r is registered; ignoring kv_connector_module_path %r",
                connector,
                kv["kv_connector_module_path"],
            )

    additional = dict(args.additional_config or {})
    _check_additional_config(additional, kv_role, env)
    return EngineConfig(
        args=args,
        kv=kv,
        kv_role=kv_role,
        role=ROLE_OF_KV_ROLE[kv_role],
        engine_id_base=engine_id_base,
        kv_port=kv_port,
        additional=additional,
        dp_ranks=dp_ranks,
        tp=tp,
        pp=pp,
    )


def _check_mooncake_config(kv: dict[str, Any], kv_role: str | None, tp: int, dp: int) -> None:
    extra = kv.get("kv_connector_extra_config")
    if not isinstance(extra, dict):
        raise SimError(
            "--kv-transfer-config: MooncakeConnectorV1 needs kv_connector_extra_config with "
            "'prefill' and 'decode' {dp_size, tp_size}"
        )
    sizes = {}
    for side in ("prefill", "decode"):
        part = extra.get(side)
        if not isinstance(part, dict):
            raise SimError(
                f"--kv-transfer-config: kv_connector_extra_config.{side} is required (with dp_size and tp_size)"
            )
        for key in ("dp_size", "tp_size"):
            if key not in part:
                raise SimError(f"--kv-transfer-config: kv_connector_extra_config.{side}.{key} is required")
            try:
                part[key] = int(part[key])
            except (TypeError, ValueError):
                raise SimError(
                    f"--kv-transfer-config: kv_connector_extra_config.{side}.{key} must be an "
                    f"integer, got {part[key]!r}"
                ) from None
        sizes[side] = part
    if int(sizes["decode"].get("pp_size", 1)) != 1:
        raise SimError("--kv-transfer-config: kv_connector_extra_config.decode.pp_size must be 1")
    own_side = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(kv_role or "")
    if own_side:
        for key, own, flag in (
            ("tp_size", tp, "--tensor-parallel-size"),
            ("dp_size", dp, "--data-parallel-size"),
        ):
            if sizes[own_side][key] != own:
                raise SimError(
                    f"ValueError: kv_connector_extra_config.{own_side}.{key} "
                    f"({sizes[own_side][key]}) must equal {flag} ({own}) on a {kv_role}"
                )
    p_tp, d_tp = sizes["prefill"]["tp_size"], sizes["decode"]["tp_size"]
    if p_tp < d_tp:
        raise SimError(
            f"ValueError: prefill tp_size ({p_tp}) must be >= decode tp_size ({d_tp}) for {kv.get('kv_connector')}"
        )


def _check_additional_config(additional: dict[str, Any], kv_role: str | None, env: dict[str, str]) -> None:
    for key in REMOVED_ADDITIONAL_KEYS:
        if key in additional:
            log.warning("additional_config key %r was removed in vllm-ascend v0.12.0rc1 and is ignored", key)
    balance = additional.get("enable_balance_scheduling")
    if balance is None and "VLLM_ASCEND_BALANCE_SCHEDULING" in env:
        log.warning("VLLM_ASCEND_BALANCE_SCHEDULING is deprecated; use additional_config 'enable_balance_scheduling'")
        balance = env["VLLM_ASCEND_BALANCE_SCHEDULING"]
    if _flag_true(balance) and kv_role in ("kv_producer", "kv_consumer"):
        raise SimError(
            f"ValueError: balance scheduling (enable_balance_scheduling / "
            f"VLLM_ASCEND_BALANCE_SCHEDULING) is not supported with P/D disaggregation "
            f"(kv_role={kv_role}); it needs kv_role kv_both or no kv_transfer_config"
        )
    if _flag_true(additional.get("recompute_scheduler_enable")):
        if kv_role == "kv_producer":
            log.warning("recompute_scheduler_enable is only for decode nodes; forcing it off on this kv_producer")
            additional["recompute_scheduler_enable"] = False
        elif kv_role is None:
            raise SimError(
                "ValueError: recompute_scheduler_enable needs P/D disaggregation (a kv_consumer); "
                "it is not supported in mixed deployment"
            )
    if _flag_true(additional.get("enable_reduce_sample")) and kv_role == "kv_producer":
        raise SimError("ValueError: enable_reduce_sample is not supported on a kv_producer")


# --------------------------------------------------------------------------------------------------
# Host boundary: simulator state dir, NPU claims, faults.
# --------------------------------------------------------------------------------------------------

DEFAULT_HOST = {
    "hardware": "atlas-800-a3",
    "npus": 16,
    "chip_name": "Ascend910",
    "hbm_mb": 65536,
    "device_ips": [],
    "load_gib_per_s": 2.0,
}
SIM_KNOBS = {  # host.json "sim" key -> (env override, default)
    "prefill_tokens_per_s": ("KIMI_SIM_PREFILL_TOKENS_PER_S", 20000.0),
    "tpot_s": ("KIMI_SIM_TPOT_S", 0.02),
    "kv_timeout_s": ("KIMI_SIM_KV_TIMEOUT_S", 10.0),
}


def load_host(state_dir: Path) -> dict[str, Any]:
    """host.json of this simulated host, or a 16-NPU default when it is absent."""
    path = state_dir / "host.json"
    if not path.is_file():
        log.warning("%s not found: running as if on a 16-NPU %s host", path, DEFAULT_HOST["hardware"])
        return dict(DEFAULT_HOST)
    try:
        host = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SimError(f"cannot read {path}: {exc}") from None
    return {**DEFAULT_HOST, **host}


def sim_knob(host: dict[str, Any], env: dict[str, str], key: str) -> float:
    env_name, default = SIM_KNOBS[key]
    raw = env.get(env_name, (host.get("sim") or {}).get(key, default))
    try:
        return float(raw)
    except (TypeError, ValueError):
        raise SimError(f"invalid value for {env_name} / host.json sim.{key}: {raw!r}") from None


def load_faults(state_dir: Path) -> dict[str, Any]:
    path = state_dir / "faults.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError) as exc:
        raise SimError(f"cannot read {path}: {exc}") from None


def fault_applies(faults: dict[str, Any], name: str, role: str) -> bool:
    roles = faults.get(name) or []
    return "*" in roles or role in roles


def parse_visible_devices(env: dict[str, str], npus: int, needed: int) -> list[int]:
    """ASCEND_RT_VISIBLE_DEVICES as NPU ids; each must exist and the count must fit the parallel layout."""
    raw = env.get("ASCEND_RT_VISIBLE_DEVICES")
    if raw is None or not raw.strip():
        raise SimError("ASCEND_RT_VISIBLE_DEVICES is not set: the engine needs the NPU ids of this DP rank")
    try:
        devices = [int(part) for part in raw.split(",")]
    except ValueError:
        raise SimError(f"ASCEND_RT_VISIBLE_DEVICES={raw!r} is not a comma-separated list of NPU ids") from None
    if len(set(devices)) != len(devices):
        raise SimError(f"ASCEND_RT_VISIBLE_DEVICES={raw!r} names an NPU twice")
    missing = [d for d in devices if not 0 <= d < npus]
    if missing:
        raise SimError(
            f"RuntimeError: ASCEND_RT_VISIBLE_DEVICES={raw!r} names NPU(s) {missing} but this host "
            f"has {npus} NPUs (0..{npus - 1}); device init failed"
        )
    if len(devices) != needed:
        raise SimError(
            f"ASCEND_RT_VISIBLE_DEVICES has {len(devices)} NPU(s) but the engine needs {needed} "
            f"(tensor_parallel_size x pipeline_parallel_size x local DP ranks)"
        )
    return devices


def _pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie holds no NPU memory); /proc answers for any user."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return True
    return state != "Z"


def _claim_holder(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


class NpuClaims:
    """Exclusive per-NPU claim files under KIMI_SIM_DIR/claims, the sim's stand-in for device ownership."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "claims"
        self.pid = os.getpid()
        self.held: list[Path] = []

    def claim(self, devices: list[int]) -> None:
        """Claim every NPU or none; a live holder is an error, a dead one is taken over."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SimError(f"cannot create NPU claim dir {self.dir}: {exc}") from None
        # The lock makes "check for a stale holder, remove, create" one step across engines.
        with open(self.dir / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            taken: list[Path] = []
            try:
                for npu in devices:
                    taken.append(self._claim_one(npu))
            except BaseException:
                for path in taken:
                    path.unlink(missing_ok=True)
                raise
        self.held = taken

    def _claim_one(self, npu: int) -> Path:
        path = self.dir / f"npu{npu}"
        while True:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _claim_holder(path)
                if holder == self.pid:
                    return path
                if holder is not None and _pid_alive(holder):
                    raise SimError(
                        f"RuntimeError: NPU {npu} is already in use by process {holder} "
                        f"(claim {path}); device init failed. Stop that engine or fix "
                        "ASCEND_RT_VISIBLE_DEVICES"
                    ) from None
                log.warning("NPU %d: stale claim by PID %s (process gone), taking it over", npu, holder)
                path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as handle:
                handle.write(f"{self.pid}\n")
            return path

    def release(self) -> None:
        for path in self.held:
            if _claim_holder(path) == self.pid:
                path.unlink(missing_ok=True)
        self.held = []


# --------------------------------------------------------------------------------------------------
# Model directory, memory and KV-cache sizing.
# --------------------------------------------------------------------------------------------------

KIMI_KV_BYTES_PER_TOKEN = (512 + 64) * 61 * 2  # MLA latent + rope dims x layers x bf16 (Kimi K2 config)
ACTIVATION_RESERVE = 2 * 1024**3


@dataclass
class ModelInfo:
    """What the sim learned from the model directory."""

    path: Path
    config: dict[str, Any]
    checkpoint_bytes: int
    num_files: int


def load_model_dir(model: str) -> ModelInfo:
    path = Path(model)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise SimError(
            f"ValueError: Invalid repository ID or local directory specified: {model!r}. Please verify: "
            "1. a valid Hugging Face / ModelScope repository ID, or 2. a local directory that contains "
            "a recognized configuration file (config.json)."
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SimError(f"cannot parse {config_path}: {exc}") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SimError(f"RuntimeError: Cannot find any model weights with `{model}` (no *.safetensors files)")
    return ModelInfo(
        path=path, config=config, checkpoint_bytes=sum(f.stat().st_size for f in files), num_files=len(files)
    )


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Kimi K2.5 is multimodal: the language model's keys live under text_config."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def resolve_max_model_len(args: argparse.Namespace, config: dict[str, Any], env: dict[str, str]) -> int:
    derived = text_config(config).get("max_position_embeddings")
    if args.max_model_len is None:
        return int(derived) if derived else 2048
    if derived and args.max_model_len > int(derived) and env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1":
        raise SimError(
            f"ValueError: User-specified max_model_len ({args.max_model_len}) is greater than the "
            f"derived max_model_len (max_position_embeddings={derived} in the model's config.json). "
            "To allow overriding this maximum, set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
        )
    return args.max_model_len


def kv_bytes_per_token(config: dict[str, Any], tp: int) -> int:
    text = text_config(config)
    layers = int(text.get("num_hidden_layers", 61))
    if "kv_lora_rank" in text:
        # MLA keeps one latent KV per token, replicated on every TP rank.
        return (int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim", 64))) * layers * 2
    if "num_key_value_heads" in text and "hidden_size" in text:
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"]))
        kv_heads = max(1, int(text["num_key_value_heads"]) // tp)
        return 2 * kv_heads * head_dim * layers * 2
    return KIMI_KV_BYTES_PER_TOKEN


def plan_memory(cfg: EngineConfig, model: ModelInfo, host: dict[str, Any], max_model_len: int, block_size: int) -> int:
    """Per-NPU weights and KV budget like vLLM's profiling run; returns the number of KV blocks."""
    args = cfg.args
    # With expert parallel the experts (almost all of a MoE checkpoint) spread over DP x TP.
    shards = cfg.tp * cfg.pp * (args.data_parallel_size if args.enable_expert_parallel else 1)
    weights = model.checkpoint_bytes / shards
    hbm = int(host["hbm_mb"]) * 1024**2
    budget = hbm * args.gpu_memory_utilization
    gib = 1024**3
    log.info("Model loading took %.4f GiB memory per NPU", weights / gib)
    if weights > budget:
        raise SimError(
            f"RuntimeError: NPU out of memory. Tried to allocate {weights / gib:.2f} GiB of weights per "
            f"NPU ({model.checkpoint_bytes / gib:.2f} GiB over {shards} NPU shard(s)); NPU has "
            f"{hbm / gib:.2f} GiB total, gpu_memory_utilization={args.gpu_memory_utilization}"
        )
    free = budget - weights - ACTIVATION_RESERVE
    if free <= 0:
        raise SimError(
            "ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine."
        )
    per_token = kv_bytes_per_token(model.config, cfg.tp)
    num_blocks = int(free // (per_token * block_size))
    capacity = num_blocks * block_size
    log.info("Available KV cache memory: %.2f GiB", free / gib)
    log.info("NPU KV cache size: %s tokens", f"{capacity:,}")
    if capacity < max_model_len:
        est = capacity
        raise SimError(
            f"ValueError: To serve at least one request with the model's max seq len ({max_model_len}), "
            f"({max_model_len * per_token / gib:.2f} GiB KV cache is needed, which is larger than the "
            f"available KV cache memory ({free / gib:.2f} GiB). Based on the available memory, the "
            f"estimated maximum model length is {est}. Try increasing `gpu_memory_utilization` or "
            "decreasing `max_model_len` when initializing the engine."
        )
    log.info("Maximum concurrency for %s tokens per request: %.2fx", f"{max_model_len:,}", capacity / max_model_len)
    return num_blocks


# --------------------------------------------------------------------------------------------------
# Prometheus exposition (vLLM's names and buckets).
# --------------------------------------------------------------------------------------------------

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")
# vLLM's vllm:prompt_tokens_by_source sources (vllm/v1/metrics/stats.py PromptTokenStats.ALL_SOURCES).
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def _label_str(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = []
    for name, value in zip(names, values):
        escaped = str(value).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
        parts.append(f'{name}="{escaped}"')
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class Metric:
    """One metric family: counter, gauge or histogram, with label tuples as keys."""

    def __init__(self, name: str, kind: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...] = ()):
        self.name, self.kind, self.doc, self.labels, self.buckets = name, kind, doc, labels, buckets
        self.values: dict[tuple[str, ...], Any] = {}
        self.lock = threading.Lock()

    def touch(self, key: tuple[str, ...]) -> None:
        with self.lock:
            if key not in self.values:
                self.values[key] = [[0] * len(self.buckets), 0.0, 0] if self.kind == "histogram" else 0.0

    def inc(self, key: tuple[str, ...], amount: float = 1.0) -> None:
        self.touch(key)
        with self.lock:
            self.values[key] += amount

    def set(self, key: tuple[str, ...], value: float) -> None:
        with self.lock:
            self.values[key] = float(value)

    def observe(self, key: tuple[str, ...], value: float) -> None:
        self.touch(key)
        with self.lock:
            counts, _, _ = entry = self.values[key]
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    counts[i] += 1
                    break
            entry[1] += value
            entry[2] += 1

    def get(self, key: tuple[str, ...]) -> float:
        with self.lock:
            value = self.values.get(key, 0.0)
            return value[2] if self.kind == "histogram" else value

    def render(self) -> str:
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} {self.kind}"]
        with self.lock:
            for key, value in sorted(self.values.items()):
                if self.kind != "histogram":
                    lines.append(f"{self.name}{_label_str(self.labels, key)} {float(value)!r}")
                    continue
                counts, total, count = value
                running = 0
                for bound, n in zip(self.buckets, counts):
                    running += n
                    le = 'le="' + repr(float(bound)) + '"'
                    lines.append(f"{self.name}_bucket{_label_str(self.labels, key, le)} {float(running)!r}")
                inf = _label_str(self.labels, key, 'le="+Inf"')
                lines.append(f"{self.name}_bucket{inf} {float(count)!r}")
                lines.append(f"{self.name}_sum{_label_str(self.labels, key)} {float(total)!r}")
                lines.append(f"{self.name}_count{_label_str(self.labels, key)} {float(count)!r}")
        return "\n".join(lines) + "\n"


class Metrics:
    """The engine's metric families; `engine` is the DP rank, as vLLM labels external-DP engines."""

    BASE = ("model_name", "engine")

    def __init__(self) -> None:
        b = self.BASE
        m = Metric
        self.running = m("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", b)
        self.waiting = m("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", b)
        self.kv_usage = m("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", b)
        self.prompt_tokens = m("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", b)
        self.prompt_by_source = m("vllm:prompt_tokens_by_source_total", "counter", "Number of prompt tokens by source.",
                                  (*b, "source"))
        self.gen_tokens = m("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", b)
        self.success = m(
            "vllm:request_success_total",
            "counter",
            "Count of successfully processed requests.",
            (*b, "finished_reason"),
        )
        self.preemptions = m(
            "vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", b
        )
        self.ext_queries = m(
            "vllm:external_prefix_cache_queries_total",
            "counter",
            "External prefix cache "
            "queries from KV connector cross-instance cache sharing, in terms of number of "
            "queried tokens.",
            b,
        )
        self.ext_hits = m(
            "vllm:external_prefix_cache_hits_total",
            "counter",
            "External prefix cache hits from "
            "KV connector cross-instance cache sharing, in terms of number of cached tokens.",
            b,
        )
        self.ttft = m(
            "vllm:time_to_first_token_seconds",
            "histogram",
            "Histogram of time to first token in seconds.",
            b,
            TTFT_BUCKETS,
        )
        self.itl = m(
            "vllm:inter_token_latency_seconds",
            "histogram",
            "Histogram of inter-token latency in seconds.",
            b,
            ITL_BUCKETS,
        )
        self.req_tpot = m(
            "vllm:request_time_per_output_token_seconds",
            "histogram",
            "Histogram of time_per_output_token_seconds per request.",
            b,
            ITL_BUCKETS,
        )
        self.e2e = m(
            "vllm:e2e_request_latency_seconds",
            "histogram",
            "Histogram of e2e request latency in seconds.",
            b,
            E2E_BUCKETS,
        )
        # Simulator-only families (kimi_sim: prefix): the KV hand-over that real vLLM does not count.
        self.kv_held = m(
            "kimi_sim:kv_transfer_held_requests",
            "gauge",
            "Prefill KV entries waiting to be pulled by a decode engine.",
            b,
        )
        self.kv_sent_reqs = m(
            "kimi_sim:kv_transfer_sent_requests_total",
            "counter",
            "Prefill KV entries a decode engine pulled and released.",
            b,
        )
        self.kv_sent_blocks = m(
            "kimi_sim:kv_transfer_sent_blocks_total",
            "counter",
            "KV blocks pulled from this prefill engine.",
            b,
        )
        self.kv_expired = m(
            "kimi_sim:kv_transfer_expired_requests_total",
            "counter",
            "Prefill KV entries freed unpulled after VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT.",
            b,
        )
        self.kv_pulled_reqs = m(
            "kimi_sim:kv_transfer_pulled_requests_total",
            "counter",
            "Requests whose prompt KV this decode engine pulled from a prefill engine.",
            b,
        )
        self.kv_pulled_blocks = m(
            "kimi_sim:kv_transfer_pulled_blocks_total",
            "counter",
            "KV blocks pulled by this decode engine.",
            b,
        )
        self.kv_pulled_tokens = m(
            "kimi_sim:kv_transfer_pulled_tokens_total",
            "counter",
            "Prompt tokens whose KV this decode engine pulled.",
            b,
        )
        self.kv_failed = m(
            "kimi_sim:kv_transfer_failed_requests_total",
            "counter",
            "Requests failed because the KV pull from the prefill engine failed.",
            b,
        )
        self.info = m(
            "kimi_sim:engine_info",
            "gauge",
            "Simulated engine identity (always 1).",
            (*b, "role", "kv_role", "engine_id", "devices", "hardware", "vllm_ascend_version"),
        )
        # prometheus_client's process collector in a single-API-server vLLM: restarts show as a new start time.
        self.process_start = m("process_start_time_seconds", "gauge",
                               "Start time of the process since unix epoch in seconds.", ())
        self.process_start.set((), time.time())
        self.families = [
            self.process_start,
            self.running,
            self.waiting,
            self.kv_usage,
            self.prompt_tokens,
            self.prompt_by_source,
            self.gen_tokens,
            self.success,
            self.preemptions,
            self.ext_queries,
            self.ext_hits,
            self.ttft,
            self.itl,
            self.req_tpot,
            self.e2e,
            self.kv_held,
            self.kv_sent_reqs,
            self.kv_sent_blocks,
            self.kv_expired,
            self.kv_pulled_reqs,
            self.kv_pulled_blocks,
            self.kv_pulled_tokens,
            self.kv_failed,
            self.info,
        ]

    def register_engine(self, key: tuple[str, str]) -> None:
        """Create every series at zero, as vLLM does when it starts."""
        for family in self.families:
            if family is self.success:
                for reason in FINISH_REASONS:
                    family.touch((*key, reason))
            elif family is self.prompt_by_source:
                for source in PROMPT_SOURCES:
                    family.touch((*key, source))
            elif family.labels == self.BASE:
                family.touch(key)

    def render(self, engine_stats: bool = True) -> str:
        """Text exposition; without engine stats (--disable-log-stats) vLLM exports no vllm: families."""
        return "".join(f.render() for f in self.families if engine_stats or not f.name.startswith("vllm:"))


# --------------------------------------------------------------------------------------------------
# The simulated engine core: tokenizer, scheduler slots, KV blocks, generation, Mooncake-style P/D.
# --------------------------------------------------------------------------------------------------

VOCAB_SIZE = 163840  # Kimi K2 vocabulary
WORDS = (
    "the", "cluster", "prefill", "decode", "kernel", "tensor", "expert", "router", "token", "cache", "block",
    "latency", "stream", "ascend", "atlas", "node", "rank", "graph", "model", "weight", "shard", "memory",
    "bandwidth", "pipeline", "batch", "queue", "signal", "vector", "matrix", "layer", "attention", "moon",
    "kimi", "swift", "quiet", "bright", "steady", "river", "mountain", "harbor", "lantern", "orbit",
    "meadow", "cobalt", "amber", "delta", "echo", "falcon", "granite", "horizon", "island", "jasper",
)  # fmt: skip
KIMI_SPECIAL = {
    "system": "<|im_system|>",
    "user": "<|im_user|>",
    "assistant": "<|im_assistant|>",
    "tool": "<|im_system|>",
}


def tokenize(text: str) -> list[int]:
    """Deterministic stand-in tokenizer: about one token per four characters of each word."""
    ids = []
    for word in text.split():
        for i in range(0, len(word), 4):
            ids.append(zlib.crc32(word[i : i + 4].encode()) % VOCAB_SIZE)
    return ids


def render_chat(messages: list[Any]) -> str:
    """Kimi's chat template, flattened to text (non-text parts become a media placeholder)."""
    out = []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError("each message needs a 'role'")
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(
                part.get("text", "") if isinstance(part, dict) and part.get("type") == "text" else "<|media_pad|>"
                for part in content
            )
        role = str(message["role"])
        out.append(f"{KIMI_SPECIAL.get(role, '<|im_user|>')}{role}<|im_middle|> {content or ''} <|im_end|>")
    out.append("<|im_assistant|>assistant<|im_middle|>")
    return " ".join(out)


def plan_output(prompt_ids: list[int], max_tokens: int, min_tokens: int, ignore_eos: bool) -> tuple[list[str], str]:
    """Deterministic continuation of a prompt; P and D agree on it because both seed from the prompt ids."""
    rng = random.Random(zlib.crc32(json.dumps(prompt_ids[-512:]).encode()) ^ len(prompt_ids))
    natural = 8 + rng.randrange(57)  # where the "model" would emit EOS
    count, reason = max_tokens, "length"
    if not ignore_eos and max(natural, min_tokens) < max_tokens:
        count, reason = max(natural, min_tokens), "stop"
    return [" " + rng.choice(WORDS) for _ in range(count)], reason


class RequestError(Exception):
    """A request-level failure returned to the client as an OpenAI-style error."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass
class KvEntry:
    """Prompt KV a prefill engine keeps for a decode engine to pull."""

    request_id: str
    prompt_ids: list[int]
    block_ids: list[int]
    created: float


@dataclass
class GenRequest:
    """A validated generation request handed to an engine core."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    kv_params: dict[str, Any] | None
    mode: str  # "local", "remote_decode" (this is P) or "remote_prefill" (this is D)


@dataclass
class GenResult:
    pieces: list[str]
    finish_reason: str
    kv_params: dict[str, Any] | None = None
    pulled_tokens: int = 0
    stop_reason: str | None = None  # "recomputed": the RecomputeScheduler dropped it back to the P/D proxy


@dataclass
class EngineCore:
    """One DP rank: scheduler slots, KV blocks and, for a producer, the KV held for decode engines."""

    rank: int
    engine_id: str
    devices: list[int]
    num_blocks: int
    block_size: int
    max_num_seqs: int
    labels: tuple[str, str]
    side_port: int | None = None
    free_blocks: deque[int] = field(default_factory=deque)
    kv_store: dict[str, KvEntry] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)
    running: int = 0
    waiting: int = 0

    def __post_init__(self) -> None:
        self.free_blocks.extend(range(self.num_blocks))


class Simulator:
    """The API server's view: engine cores, metrics, timing knobs and the P/D protocol."""

    def __init__(
        self,
        *,
        cfg: EngineConfig,
        host: dict[str, Any],
        env: dict[str, str],
        served: list[str],
        max_model_len: int,
        metrics: Metrics,
        advertised_host: str,
    ) -> None:
        self.cfg, self.host, self.env, self.served = cfg, host, env, served
        self.max_model_len, self.metrics, self.advertised_host = max_model_len, metrics, advertised_host
        self.prefill_tps = sim_knob(host, env, "prefill_tokens_per_s")
        self.tpot = sim_knob(host, env, "tpot_s")
        self.kv_timeout = sim_knob(host, env, "kv_timeout_s")
        self.abort_timeout = float(env.get("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "480"))
        self.cores: list[EngineCore] = []
        self._rr = itertools.count()
        self.stop = threading.Event()
        self.started = time.time()
        self.state_dir = Path(env.get("KIMI_SIM_DIR", "/var/lib/kimi-sim"))

    def kv_pressure(self) -> int | None:
        """faults.json kv_pressure_tokens (sandbox fault kv-pressure): a decode engine runs out of KV cache after
        this many generated tokens of every request; read on every request."""
        if self.cfg.kv_role != "kv_consumer":
            return None
        try:
            n = load_faults(self.state_dir).get("kv_pressure_tokens")
        except SimError:
            return None
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None

    def hung(self) -> bool:
        """faults.json engine_hang_since {role: epoch seconds} (sandbox fault engine-hang-now): an engine of that role
        started before that moment stops answering completions (they stall until it is restarted or the fault is
        cleared) while /health, /v1/models and /metrics keep answering; read on every request."""
        try:
            since = load_faults(self.state_dir).get("engine_hang_since") or {}
        except SimError:
            return False
        at = [v for k, v in since.items() if k in ("*", self.cfg.role) and isinstance(v, (int, float))]
        return any(self.started < v for v in at)

    def link_down(self, core: EngineCore) -> list[int]:
        """This engine's NPUs whose device (RoCE) link is down per faults.json, read on every transfer."""
        try:
            faults = load_faults(self.state_dir)
        except SimError:
            return []
        return sorted(set(core.devices) & set(faults.get("link_down") or []))

    # -- scheduling ------------------------------------------------------------------------------

    def pick_core(self, rank_header: str | None) -> EngineCore:
        if rank_header is not None:
            for core in self.cores:
                if str(core.rank) == rank_header.strip():
                    return core
            raise RequestError(
                400,
                f"data_parallel_rank {rank_header} is not served here (ranks {[c.rank for c in self.cores]})",
            )
        return self.cores[next(self._rr) % len(self.cores)]

    def _update_gauges(self, core: EngineCore) -> None:
        self.metrics.running.set(core.labels, core.running)
        self.metrics.waiting.set(core.labels, core.waiting)
        used = core.num_blocks - len(core.free_blocks)
        self.metrics.kv_usage.set(core.labels, used / core.num_blocks if core.num_blocks else 0.0)
        self.metrics.kv_held.set(core.labels, len(core.kv_store))

    def _admit(self, core: EngineCore, n_blocks: int) -> list[int]:
        if n_blocks > core.num_blocks:
            raise RequestError(400, f"request needs {n_blocks} KV blocks, engine has {core.num_blocks}")
        with core.cond:
            core.waiting += 1
            self._update_gauges(core)
            while core.running >= core.max_num_seqs or len(core.free_blocks) < n_blocks:
                core.cond.wait(timeout=0.5)
            core.waiting -= 1
            core.running += 1
            blocks = [core.free_blocks.popleft() for _ in range(n_blocks)]
            self._update_gauges(core)
            return blocks

    def _finish(self, core: EngineCore, blocks: list[int]) -> None:
        with core.cond:
            core.running -= 1
            core.free_blocks.extend(blocks)
            self._update_gauges(core)
            core.cond.notify_all()

    def _free_entry(self, core: EngineCore, request_id: str) -> KvEntry | None:
        with core.cond:
            entry = core.kv_store.pop(request_id, None)
            if entry is not None:
                core.free_blocks.extend(entry.block_ids)
                self._update_gauges(core)
                core.cond.notify_all()
            return entry

    # -- generation ------------------------------------------------------------------------------

    def generate(self, core: EngineCore, req: GenRequest, emit) -> GenResult:
        """Run one request: prefill (or KV pull), then decode token by token, calling emit(piece, finish or None)."""
        started = time.monotonic()
        n_blocks = math.ceil(len(req.prompt_ids) / core.block_size)
        blocks = self._admit(core, n_blocks)
        keep_blocks = False
        labels = core.labels
        try:
            pulled = 0
            if req.mode == "remote_prefill":
                pulled = self.pull_kv(core, req, n_blocks)
                self.stop.wait(self.tpot)  # the KV is here; one decode step gives the first token
            else:
                self.stop.wait(len(req.prompt_ids) / self.prefill_tps)
            pieces, reason = plan_output(req.prompt_ids, req.max_tokens, req.min_tokens, req.ignore_eos)
            stop_reason = None
            pressure = self.kv_pressure()
            if pressure is not None and len(pieces) > pressure:
                if _flag_true(self.cfg.additional.get("recompute_scheduler_enable")):
                    # vllm_ascend/core/recompute_scheduler.py: a kv_consumer that cannot schedule a request frees its
                    # KV and ends it with FinishReason.STOP, no new token and stop_reason "recomputed", for the P/D
                    # proxy to replay; the final output carries no token (emitted after the loop)
                    pieces, reason, stop_reason = pieces[:pressure], "stop", "recomputed"
                else:  # vLLM's own scheduler preempts the request and recomputes it here, then goes on
                    self.metrics.preemptions.inc(labels)
                    log.info("Request %s preempted after %d tokens (KV cache full); recomputing it locally",
                             req.request_id, pressure)
            first = last = time.monotonic()
            self.metrics.ttft.observe(labels, last - started)
            for i, piece in enumerate(pieces):
                if i:
                    self.stop.wait(self.tpot)
                    now = time.monotonic()
                    self.metrics.itl.observe(labels, now - last)
                    last = now
                # as vLLM: the last token's output carries the finish reason (a recomputed request's does not)
                emit(piece, reason if i == len(pieces) - 1 and stop_reason is None else None)
            if len(pieces) > 1:
                self.metrics.req_tpot.observe(labels, (last - first) / (len(pieces) - 1))
            if stop_reason:
                self.stop.wait(self.tpot)  # the scheduler step that drops it
                log.warning("[RecomputeScheduler] Recompute triggered for request %s.", req.request_id)
            kv_out = None
            if req.mode == "remote_decode":
                kv_out = self._hold_kv(core, req, blocks, pieces)
                keep_blocks = True
            result = GenResult(pieces=pieces, finish_reason=reason, kv_params=kv_out, pulled_tokens=pulled,
                               stop_reason=stop_reason)
        except (BrokenPipeError, ConnectionResetError):
            self.metrics.success.inc((*labels, "abort"))
            raise
        finally:
            if not keep_blocks:
                self._finish(core, blocks)
            else:
                with core.cond:
                    core.running -= 1
                    self._update_gauges(core)
                    core.cond.notify_all()
        self.metrics.prompt_tokens.inc(labels, len(req.prompt_ids))
        self.metrics.prompt_by_source.inc((*labels, "external_kv_transfer"), result.pulled_tokens)
        self.metrics.prompt_by_source.inc((*labels, "local_compute"), len(req.prompt_ids) - result.pulled_tokens)
        self.metrics.gen_tokens.inc(labels, len(result.pieces))
        self.metrics.success.inc((*labels, result.finish_reason))
        self.metrics.e2e.observe(labels, time.monotonic() - started)
        return result

    # -- P/D: the prefill side -------------------------------------------------------------------

    def _hold_kv(self, core: EngineCore, req: GenRequest, blocks: list[int], pieces: list[str]) -> dict[str, Any]:
        with core.cond:
            core.kv_store[req.request_id] = KvEntry(req.request_id, req.prompt_ids, blocks, time.monotonic())
            self._update_gauges(core)
        # Field set of vllm-ascend MooncakeConnector.request_finished (vllm_ascend/distributed/kv_transfer/kv_p2p/
        # mooncake_connector.py, releases/v0.23.0).
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": blocks,
            "remote_engine_id": core.engine_id,
            "remote_request_id": req.request_id,
            "remote_host": self.advertised_host,
            "remote_port": core.side_port,
            "remote_tp_size": self.cfg.tp,
            "remote_pcp_size": 1,
            "remote_dcp_size": 1,
            "remote_ptp_size": self.cfg.tp,
            "last_token_id": tokenize(pieces[-1])[0] if pieces else None,
            "num_prompt_blocks": len(blocks),
            "remote_block_size": core.block_size,
            "remote_multi_nodes_meta_mapping": None,
        }

    def log_stats(self) -> None:
        """vLLM's periodic per-engine throughput line (every VLLM_LOG_STATS_INTERVAL seconds)."""
        interval = float(self.env.get("VLLM_LOG_STATS_INTERVAL", "10"))
        last = {core.rank: (0.0, 0.0) for core in self.cores}
        while not self.stop.wait(interval):
            for core in self.cores:
                prompt = self.metrics.prompt_tokens.get(core.labels)
                gen = self.metrics.gen_tokens.get(core.labels)
                d_prompt, d_gen = prompt - last[core.rank][0], gen - last[core.rank][1]
                last[core.rank] = (prompt, gen)
                if not (d_prompt or d_gen or core.running or core.waiting):
                    continue
                usage = 1 - len(core.free_blocks) / core.num_blocks
                log.info(
                    "Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                    "tokens/s, Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, "
                    "Prefix cache hit rate: 0.0%%",
                    core.rank,
                    d_prompt / interval,
                    d_gen / interval,
                    core.running,
                    core.waiting,
                    usage * 100,
                )

    def reap_expired(self) -> None:
        """Free KV nobody pulled within VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, like the connector does."""
        while not self.stop.wait(min(1.0, max(0.05, self.abort_timeout / 4))):
            now = time.monotonic()
            for core in self.cores:
                with core.cond:
                    expired = [rid for rid, e in core.kv_store.items() if now - e.created > self.abort_timeout]
                for rid in expired:
                    if self._free_entry(core, rid) is not None:
                        self.metrics.kv_expired.inc(core.labels)
                        log.warning(
                            "Releasing expired KV blocks for request %s which were retrieved by 0 decode "
                            "worker(s) within %s seconds.",
                            rid,
                            int(self.abort_timeout),
                        )

    # -- P/D: the decode side --------------------------------------------------------------------

    def pull_kv(self, core: EngineCore, req: GenRequest, n_blocks: int) -> int:
        """Handshake with the prefill side channel, read the KV, tell P to free it; returns tokens pulled."""
        params = req.kv_params or {}
        host, port, rid = (
            params.get("remote_host"),
            params.get("remote_port"),
            params.get("remote_request_id"),
        )
        remote = f"{host}:{port}"
        if not host or not port or not rid:
            self.metrics.kv_failed.inc(core.labels)
            raise RequestError(
                400,
                "kv_transfer_params with do_remote_prefill needs remote_host, remote_port and "
                f"remote_request_id (got {sorted(k for k, v in params.items() if v is not None)})",
            )
        remote_engine = params.get("remote_engine_id")
        base = f"http://{host}:{port}"
        try:
            down = self.link_down(core)
            if down:
                raise KvPullError(f"transfer engine: device link down on decode NPU(s) {down}")
            if remote_engine == core.engine_id:
                raise KvPullError(f"remote engine id {remote_engine} equals the local engine id")
            meta = self._side_call("GET", f"{base}/metadata")
            if remote_engine and meta.get("engine_id") != remote_engine:
                raise KvPullError(f"side channel belongs to engine {meta.get('engine_id')}, not {remote_engine}")
            if int(meta.get("tp_size", 0)) < self.cfg.tp:
                raise KvPullError(f"prefill tp_size {meta.get('tp_size')} < decode tp_size {self.cfg.tp}")
            quoted = urllib.parse.quote(str(rid), safe="")
            kv = self._side_call("GET", f"{base}/kv/{quoted}")
            remote_blocks = params.get("remote_block_ids") or []
            if len(kv["block_ids"]) != len(remote_blocks) or len(remote_blocks) != n_blocks:
                raise KvPullError(
                    f"block count mismatch: local prompt needs {n_blocks} block(s), "
                    f"kv_transfer_params has {len(remote_blocks)}, remote holds {len(kv['block_ids'])}"
                )
            if kv["prompt_token_ids"] != req.prompt_ids:
                log.warning("request %s: prompt tokens differ from the ones prefilled by %s", req.request_id, remote)
            self._side_call("POST", f"{base}/kv/{quoted}/done")
        except KvPullError as exc:
            self.metrics.kv_failed.inc(core.labels)
            log.error(
                "KV transfer for request %s from prefill engine %s at %s failed: %s",
                req.request_id,
                remote_engine,
                remote,
                exc,
            )
            raise RequestError(
                500,
                f"KV transfer from prefill engine {remote_engine} at {remote} failed for "
                f"remote_request_id {rid}: {exc}",
                "InternalServerError",
            ) from None
        tokens = len(req.prompt_ids)
        self.metrics.kv_pulled_reqs.inc(core.labels)
        self.metrics.kv_pulled_blocks.inc(core.labels, n_blocks)
        self.metrics.kv_pulled_tokens.inc(core.labels, tokens)
        # Real vLLM counts connector-loaded prompt tokens as external prefix cache queries and hits.
        self.metrics.ext_queries.inc(core.labels, tokens)
        self.metrics.ext_hits.inc(core.labels, tokens)
        return tokens

    def _side_call(self, method: str, url: str) -> dict[str, Any]:
        request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
        try:
            with urllib.request.urlopen(request, timeout=self.kv_timeout) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:200]
            raise KvPullError(f"{method} {url} -> HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise KvPullError(f"{method} {url} unreachable: {reason}") from None
        except json.JSONDecodeError:
            raise KvPullError(f"{method} {url} returned non-JSON") from None


class KvPullError(Exception):
    """The decode side could not get the prompt KV from the prefill side channel."""


# --------------------------------------------------------------------------------------------------
# HTTP: the OpenAI-compatible API server and the prefill side channel.
# --------------------------------------------------------------------------------------------------

KNOWN_REQUEST_FIELDS = frozenset((
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "min_tokens", "stream",
    "stream_options", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids", "seed", "echo",
    "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "user",
    "kv_transfer_params", "continue_final_message", "add_generation_prompt", "chat_template_kwargs", "tools",
    "tool_choice", "response_format", "suffix", "best_of", "logit_bias", "priority", "request_id",
    "include_reasoning", "reasoning_effort", "parallel_tool_calls", "documents", "chat_template",
    "cache_salt",
    "return_tokens_as_token_ids", "prompt_logprobs", "truncate_prompt_tokens", "vllm_xargs",
    "allowed_token_ids", "bad_words", "structured_outputs", "return_token_ids", "length_penalty",
))  # fmt: skip


def _sse(obj: Any) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


class ApiHandler(BaseHTTPRequestHandler):
    """OpenAI-compatible endpoints of `vllm serve`: /health, /v1/models, /v1/*completions, /metrics."""

    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    sim: Simulator  # set on the subclass made per server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        phrase = getattr(code, "phrase", None) or self.responses.get(int(code), ("",))[0]
        access_log.info(
            '%s:%s - "%s" %s %s',
            self.client_address[0],
            self.client_address[1],
            self.requestline,
            int(code),
            phrase,
        )

    # -- plumbing --------------------------------------------------------------------------------

    def _send(self, status: int, body: bytes, ctype: str = "application/json", headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode())

    def _error(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        self._json(status, {"error": {"message": message, "type": kind, "param": None, "code": status}})

    def _authorized(self) -> bool:
        key = self.sim.cfg.args.api_key or self.sim.env.get("VLLM_API_KEY")
        if not key or not self.path.startswith("/v1"):
            return True
        if self.headers.get("Authorization", "") == f"Bearer {key}":
            return True
        self._json(401, {"error": "Unauthorized"})
        return False

    def _read_json(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"null")
        except json.JSONDecodeError as exc:
            raise RequestError(400, f"request body is not valid JSON: {exc.msg}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "request body must be a JSON object")
        return body

    # -- routes ----------------------------------------------------------------------------------

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if not self._authorized():
            return
        if path in ("/health", "/ping"):
            self._send(200, b"", "text/plain")
        elif path == "/v1/models":
            self._json(200, self._models())
        elif path == "/metrics":
            text = self.sim.metrics.render(engine_stats=not self.sim.cfg.args.disable_log_stats)
            self._send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/version":
            self._json(200, {"version": VLLM_VERSION, "vllm_ascend": VLLM_ASCEND_VERSION, "engine_sim": OWNED_BY})
        elif path in ("/v1/completions", "/v1/chat/completions"):
            self._json(405, {"detail": "Method Not Allowed"})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if path in ("/health", "/v1/models", "/metrics", "/version"):
                self._json(405, {"detail": "Method Not Allowed"})
            else:
                self._json(404, {"detail": "Not Found"})
            return
        if not self._authorized():
            return
        try:
            body = self._read_json()
            self._completion(body, chat=path == "/v1/chat/completions")
        except RequestError as exc:
            self._error(exc.status, str(exc), exc.kind)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # a simulator bug must still answer like a server, not drop the socket
            log.exception("Error in request handling")
            self.close_connection = True
            self._error(500, f"{type(exc).__name__}: {exc}", "InternalServerError")

    def _models(self) -> dict[str, Any]:
        created = int(self.sim.started)
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": OWNED_BY,
                "root": self.sim.cfg.args.model,
                "parent": None,
                "max_model_len": self.sim.max_model_len,
                "permission": [],
            }
            for name in self.sim.served
        ]
        return {"object": "list", "data": data}

    def _completion(self, body: dict[str, Any], chat: bool) -> None:
        sim = self.sim
        if sim.hung():
            log.warning("simulated fault engine_hang_since: this completion stalls until a restart")
            # A hung engine holds its requests in its running batch and makes no tokens: num_requests_running counts
            # this one while no token counter moves (what `kimictl heal` judges a hang by).
            core = sim.cores[0]
            with core.cond:
                core.running += 1
                sim._update_gauges(core)
            try:
                while sim.hung():
                    if sim.stop.wait(0.5):  # shut down while hung: the request is lost, as with a killed engine
                        raise RequestError(500, "the engine shut down while hung (simulated fault engine_hang_since)")
            finally:
                with core.cond:
                    core.running -= 1
                    sim._update_gauges(core)
                    core.cond.notify_all()
        ignored = sorted(set(body) - KNOWN_REQUEST_FIELDS)
        if ignored:
            log.warning("The following fields were present in the request but ignored: %s", set(ignored))
        model = body.get("model")
        if model is not None and model not in sim.served:
            raise RequestError(404, f"The model `{model}` does not exist.", "NotFoundError")
        if body.get("n", 1) != 1:
            raise RequestError(400, "n > 1 is not supported by the engine simulator")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError(400, "'messages' must be a non-empty list")
            try:
                prompt_ids = tokenize(render_chat(messages))
            except ValueError as exc:
                raise RequestError(400, str(exc)) from None
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                prompt_ids = tokenize(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                prompt_ids = list(prompt)
            else:
                raise RequestError(
                    400,
                    "'prompt' must be a string, a one-element list or a list of token ids "
                    "(batched prompts are not simulated)",
                )
        if not prompt_ids:
            raise RequestError(400, "The prompt cannot be empty")
        default_max = 16 if not chat else sim.max_model_len - len(prompt_ids)
        max_tokens = body.get("max_completion_tokens") if chat else None
        max_tokens = max_tokens if max_tokens is not None else body.get("max_tokens")
        max_tokens = default_max if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(400, f"max_tokens must be at least 1, got {max_tokens}.")
        if len(prompt_ids) + max_tokens > sim.max_model_len:
            raise RequestError(
                400,
                f"This model's maximum context length is {sim.max_model_len} tokens. However, "
                f"you requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the "
                f"input, {max_tokens} in the completion). Please reduce the length of the input or "
                "completion.",
            )
        min_tokens = int(body.get("min_tokens") or 0)
        kv_params = body.get("kv_transfer_params")
        mode = self._pd_mode(kv_params)
        core = sim.pick_core(self.headers.get("X-data-parallel-rank"))
        base_id = self.headers.get("X-Request-Id") or uuid.uuid4().hex
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{base_id}"
        internal_id = response_id if chat else f"{response_id}-0"
        with core.cond:
            if internal_id in core.kv_store:
                internal_id = f"{internal_id}-{uuid.uuid4().hex[:8]}"
        req = GenRequest(
            request_id=internal_id,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=bool(body.get("ignore_eos")),
            kv_params=kv_params,
            mode=mode,
        )
        if sim.cfg.args.enable_log_requests:
            log.info(
                "Received request %s: prompt tokens %d, max_tokens %d, kv mode %s",
                internal_id,
                len(prompt_ids),
                max_tokens,
                mode,
            )
        served_name = model or sim.served[0]
        if body.get("stream"):
            self._stream(
                core,
                req,
                chat=chat,
                response_id=response_id,
                model=served_name,
                options=body.get("stream_options") or {},
            )
            return
        result = sim.generate(core, req, lambda piece, finish: None)
        text = "".join(result.pieces)
        usage = {
            "prompt_tokens": len(prompt_ids),
            "total_tokens": len(prompt_ids) + len(result.pieces),
            "completion_tokens": len(result.pieces),
            "prompt_tokens_details": None,
        }
        if chat:
            choice = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "reasoning_content": None,
                    "tool_calls": [],
                },
                "logprobs": None,
                "finish_reason": result.finish_reason,
                "stop_reason": result.stop_reason,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": result.finish_reason,
                "stop_reason": result.stop_reason,
                "prompt_logprobs": None,
            }
            obj = "text_completion"
        self._json(
            200,
            {
                "id": response_id,
                "object": obj,
                "created": int(time.time()),
                "model": served_name,
                "choices": [choice],
                "usage": usage,
                "kv_transfer_params": result.kv_params,
            },
        )

    def _pd_mode(self, kv_params: Any) -> str:
        if kv_params is None:
            return "local"
        if not isinstance(kv_params, dict):
            raise RequestError(400, "kv_transfer_params must be an object")
        kv_role = self.sim.cfg.kv_role
        remote_decode = bool(kv_params.get("do_remote_decode"))
        remote_prefill = bool(kv_params.get("do_remote_prefill"))
        if kv_role is None:
            if remote_decode or remote_prefill:
                log.warning("kv_transfer_params ignored: this engine has no kv_transfer_config")
            return "local"
        if remote_decode and remote_prefill:
            raise RequestError(400, "kv_transfer_params cannot set both do_remote_decode and do_remote_prefill")
        if remote_decode:
            if kv_role == "kv_consumer":
                raise RequestError(
                    400,
                    "this engine is a kv_consumer (decode); it cannot prefill for a remote decode (do_remote_decode)",
                )
            return "remote_decode"
        if remote_prefill:
            if kv_role == "kv_producer":
                raise RequestError(
                    400,
                    "this engine is a kv_producer (prefill); it cannot load KV from a remote "
                    "prefill (do_remote_prefill)",
                )
            return "remote_prefill"
        return "local"

    def _stream(
        self,
        core: EngineCore,
        req: GenRequest,
        *,
        chat: bool,
        response_id: str,
        model: str,
        options: dict[str, Any],
    ) -> None:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        started = False

        def write(chunk: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()

        def event(choices: list[dict[str, Any]], **more: Any) -> None:
            """One server-sent event: the stream's envelope around these choices."""
            write(_sse({"id": response_id, "object": obj, "created": created, "model": model, "choices": choices,
                        **more}))

        def start() -> None:
            nonlocal started
            if started:
                return
            started = True
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if chat:
                event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}])

        def chunk(piece: str, finish: str | None, stop_reason: str | None = None) -> None:
            if chat:
                delta = {"content": piece} if piece else {}
                event([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                        "stop_reason": stop_reason}])
            else:
                event([{"index": 0, "text": piece, "logprobs": None, "finish_reason": finish,
                        "stop_reason": stop_reason}])

        def emit(piece: str, finish: str | None) -> None:
            start()
            chunk(piece, finish)

        # Errors before the first token (e.g. a failed KV pull) are still plain HTTP errors, as in vLLM.
        result = self.sim.generate(core, req, emit)
        start()
        if result.stop_reason or not result.pieces:  # an output without a token: the recompute ending
            chunk("", result.finish_reason, result.stop_reason)
        if options.get("include_usage"):
            n = len(result.pieces)
            event([], usage={"prompt_tokens": len(req.prompt_ids), "total_tokens": len(req.prompt_ids) + n,
                             "completion_tokens": n})
        write(_sse("[DONE]"))
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class SideChannelHandler(BaseHTTPRequestHandler):
    """The prefill engine's KV side channel (stands in for Mooncake's ZMQ handshake + transfer engine)."""

    protocol_version = "HTTP/1.1"
    sim: Simulator
    core: EngineCore

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _entry_id(self, suffix: str = "") -> str | None:
        match = re.fullmatch(r"/kv/([^/]+)" + re.escape(suffix), self.path)
        return urllib.parse.unquote(match.group(1)) if match else None

    def do_GET(self) -> None:
        core = self.core
        if self.path == "/metadata":
            self._json(
                200,
                {
                    "engine_id": core.engine_id,
                    "dp_rank": core.rank,
                    "tp_size": self.sim.cfg.tp,
                    "block_size": core.block_size,
                    "kv_role": self.sim.cfg.kv_role,
                    "devices": core.devices,
                },
            )
            return
        rid = self._entry_id()
        down = self.sim.link_down(core)
        if down:
            # The handshake (host network) works; the transfer over the NPU's RoCE link does not.
            self._json(503, {"error": f"transfer engine: device link down on prefill NPU(s) {down}"})
            return
        with core.cond:
            entry = core.kv_store.get(rid) if rid else None
        if entry is None:
            self._json(
                404,
                {
                    "error": f"no KV held for request {rid!r} on engine {core.engine_id} (never prefilled "
                    "here, already pulled, or expired)"
                },
            )
            return
        self._json(
            200,
            {
                "request_id": entry.request_id,
                "engine_id": core.engine_id,
                "prompt_token_ids": entry.prompt_ids,
                "block_ids": entry.block_ids,
                "num_prompt_blocks": len(entry.block_ids),
                "block_size": core.block_size,
            },
        )

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        rid = self._entry_id("/done")
        entry = self.sim._free_entry(self.core, rid) if rid else None
        if entry is None:
            self._json(404, {"error": f"no KV held for request {rid!r} on engine {self.core.engine_id}"})
            return
        self.sim.metrics.kv_sent_reqs.inc(self.core.labels)
        self.sim.metrics.kv_sent_blocks.inc(self.core.labels, len(entry.block_ids))
        self._json(200, {"freed_blocks": len(entry.block_ids)})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


def make_server(host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> _Server:
    """Bind without listening yet (vLLM binds its HTTP socket before the engine starts); raises OSError."""
    server = (_Server6 if ":" in host else _Server)((host, port), handler, bind_and_activate=False)
    try:
        server.server_bind()
    except OSError:
        server.server_close()
        raise
    return server


def advertised_ip(args: argparse.Namespace, env: dict[str, str]) -> str:
    """The IP a decode engine uses to reach us: VLLM_HOST_IP, else --host, else the route to the DP master."""
    if env.get("VLLM_HOST_IP"):
        return env["VLLM_HOST_IP"]
    if args.host and args.host not in ("0.0.0.0", "::", ""):
        return args.host
    for target in (args.data_parallel_address, "8.8.8.8"):
        if not target:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 80))  # UDP connect sends nothing; it only picks the route
                return probe.getsockname()[0]
        except OSError:
            continue
    return "127.0.0.1"


# --------------------------------------------------------------------------------------------------
# Startup.
# --------------------------------------------------------------------------------------------------


class _Below(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


def setup_logging(uvicorn_level: str, access: bool) -> None:
    """vLLM-style lines; INFO/WARNING to stdout, ERROR and above to stderr."""
    fmt = logging.Formatter(
        f"(APIServer pid={os.getpid()}) %(levelname)s %(asctime)s [%(module)s.py:%(lineno)d] %(message)s",
        "%m-%d %H:%M:%S",
    )
    out = logging.StreamHandler(sys.stdout)
    out.addFilter(_Below(logging.ERROR))
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.ERROR)
    for handler in (out, err):
        handler.setFormatter(fmt)
    log.handlers[:] = [out, err]
    log.setLevel(logging.INFO)
    log.propagate = False
    access_handler = logging.StreamHandler(sys.stdout)
    access_handler.setFormatter(logging.Formatter(f"(APIServer pid={os.getpid()}) %(levelname)s:     %(message)s"))
    access_log.handlers[:] = [access_handler]
    level = {"trace": logging.DEBUG}.get(uvicorn_level, getattr(logging, uvicorn_level.upper(), logging.INFO))
    access_log.setLevel(level if access else logging.CRITICAL + 1)
    access_log.propagate = False


def _non_default_args(args: argparse.Namespace) -> dict[str, Any]:
    defaults = vars(build_parser().parse_args([args.model]))
    return {k: v for k, v in vars(args).items() if k not in ("model_tag",) and defaults.get(k) != v}


def run(argv: list[str], env: dict[str, str]) -> int:
    """`vllm serve ...`: returns the process exit code."""
    args = parse_cli(argv)
    setup_logging(args.uvicorn_log_level, not args.disable_uvicorn_access_log)
    state_dir = Path(env.get("KIMI_SIM_DIR", "/var/lib/kimi-sim"))
    claims = NpuClaims(state_dir)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("Received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    servers: list[_Server] = []
    placeholders: list[socket.socket] = []
    sim: Simulator | None = None
    try:
        log.info(
            "vLLM API server version %s (vllm-ascend %s, simulated by %s)",
            VLLM_VERSION,
            VLLM_ASCEND_VERSION,
            OWNED_BY,
        )
        log.info("non-default args: %s", _non_default_args(args))
        kv_role = (args.kv_transfer_config or {}).get("kv_role")
        role = ROLE_OF_KV_ROLE.get(kv_role, "colocated")
        faults = load_faults(state_dir)
        spared = env.get("KIMICTL_TAG") in (faults.get("engine_crash_spare_tags") or [])
        if fault_applies(faults, "engine_crash_at_start", role) and not spared:
            raise SimError(
                f"RuntimeError: Engine core initialization failed. Failed core proc(s): "
                f"{{'EngineCore_DP{args.data_parallel_rank or 0}': 1}} (simulated fault "
                f"engine_crash_at_start for role {role!r} from {state_dir / 'faults.json'})"
            )
        cfg = check_engine_config(args, env)
        host = load_host(state_dir)
        model = load_model_dir(args.model)
        max_model_len = resolve_max_model_len(args, model.config, env)
        served = args.served_model_name or [args.model]
        bind_host = args.host or "0.0.0.0"
        api = None
        if not args.headless:
            try:
                api = make_server(bind_host, args.port, type("Api", (ApiHandler,), {}))
            except OSError as exc:
                raise SimError(
                    f"OSError: [Errno {exc.errno}] {exc.strerror}: API server cannot bind {bind_host}:{args.port}"
                ) from None
            servers.append(api)
        devices = parse_visible_devices(env, int(host["npus"]), cfg.tp * cfg.pp * len(cfg.dp_ranks))
        unhealthy = sorted(set(devices) & set(faults.get("npu_unhealthy") or []))
        if unhealthy:
            raise SimError(
                f"RuntimeError: ACL device init failed on NPU(s) {unhealthy}: device health is Critical "
                "(see `npu-smi info`)"
            )
        claims.claim(devices)
        log.info("Claimed NPU(s) %s on %s (%s)", devices, host.get("hardware"), host.get("chip_name"))

        gib = 1024**3
        load_s = model.checkpoint_bytes / (float(host.get("load_gib_per_s") or 2.0) * gib)
        if "KIMI_SIM_LOAD_SECONDS" in env:
            try:
                load_s = float(env["KIMI_SIM_LOAD_SECONDS"])
            except ValueError:
                raise SimError(f"KIMI_SIM_LOAD_SECONDS={env['KIMI_SIM_LOAD_SECONDS']!r} is not a number") from None
        log.info(
            "Starting to load model %s (%d safetensors file(s), %.2f GiB)...",
            args.model,
            model.num_files,
            model.checkpoint_bytes / gib,
        )
        if fault_applies(faults, "engine_hang_in_load", role):
            log.warning("Loading weights is taking longer than expected...")
            stop.wait()  # simulated fault engine_hang_in_load: never ready, port never listens
            return 0
        if stop.wait(load_s):
            return 0
        log.info("Loading weights took %.2f seconds", load_s)
        block_size = args.block_size or 128  # vllm-ascend's default block size
        num_blocks = plan_memory(cfg, model, host, max_model_len, block_size)

        metrics = Metrics()
        sim = Simulator(
            cfg=cfg,
            host=host,
            env=env,
            served=served,
            max_model_len=max_model_len,
            metrics=metrics,
            advertised_host=advertised_ip(args, env),
        )
        sim.stop = stop
        per_engine = cfg.tp * cfg.pp
        for i, rank in enumerate(cfg.dp_ranks):
            core = EngineCore(
                rank=rank,
                engine_id=f"{cfg.engine_id_base}-{uuid.uuid4().hex}_dp{rank}",
                devices=devices[i * per_engine : (i + 1) * per_engine],
                num_blocks=num_blocks,
                block_size=block_size,
                max_num_seqs=args.max_num_seqs or 256,
                labels=(served[0], str(rank)),
            )
            metrics.register_engine(core.labels)
            metrics.info.set(
                (
                    *core.labels,
                    role,
                    str(cfg.kv_role or ""),
                    core.engine_id,
                    ",".join(map(str, core.devices)),
                    str(host.get("hardware")),
                    VLLM_ASCEND_VERSION,
                ),
                1,
            )
            sim.cores.append(core)
        if not args.disable_log_stats:
            threading.Thread(target=sim.log_stats, name="stats-logger", daemon=True).start()
        if cfg.kv_role in ("kv_producer", "kv_both") and cfg.kv_port is not None:
            for core in sim.cores:
                placeholders += _start_side_channel(sim, core, cfg, servers)
            threading.Thread(target=sim.reap_expired, name="kv-reaper", daemon=True).start()
        for core in sim.cores:
            log.info(
                "Engine DP rank %d ready: engine_id=%s devices=%s%s",
                core.rank,
                core.engine_id,
                core.devices,
                f" kv side channel {sim.advertised_host}:{core.side_port}" if core.side_port else "",
            )
        if api is None:
            log.info("Headless mode: engine(s) %s running without an API server", cfg.dp_ranks)
        else:
            api.RequestHandlerClass.sim = sim  # type: ignore[attr-defined]
            api.server_activate()
            threading.Thread(target=api.serve_forever, name="api-server", daemon=True).start()
            log.info("Starting vLLM API server 0 on http://%s:%d", bind_host, args.port)
            log.info("Application startup complete.")
        stop.wait()
        return 0
    except SimError as exc:
        log.error("%s", exc)
        return exc.code
    finally:
        stop.set()
        for server in servers:
            server.server_close()
        for sock in placeholders:
            sock.close()
        claims.release()


def _start_side_channel(
    sim: Simulator, core: EngineCore, cfg: EngineConfig, servers: list[_Server]
) -> list[socket.socket]:
    """Bind the KV side channel: one port per TP worker from kv_port + dp_rank * tp * pp (Mooncake connector)."""
    # Like the connector's ZMQ ROUTER: bound on the advertised IP (get_ip()), not on --host.
    bind_host = sim.advertised_host
    base = int(cfg.kv_port or 0) + core.rank * cfg.tp * cfg.pp
    handler = type("SideChannel", (SideChannelHandler,), {"sim": sim, "core": core})
    try:
        server = make_server(bind_host, base, handler)
    except OSError as exc:
        raise SimError(
            f"zmq.error.ZMQError: {exc.strerror} (addr='tcp://{bind_host}:{base}'): the Mooncake side "
            f"channel of DP rank {core.rank} (kv_port {cfg.kv_port} + {core.rank} x {cfg.tp * cfg.pp})"
        ) from None
    servers.append(server)
    server.server_activate()
    threading.Thread(target=server.serve_forever, name=f"kv-side-{core.rank}", daemon=True).start()
    core.side_port = base
    held = []
    # The other TP workers' handshake ports: held so an overlapping kv_port range fails like the real one.
    for port in range(base + 1, base + cfg.tp * cfg.pp):
        sock = socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET)
        try:
            sock.bind((bind_host, port))
            sock.listen(1)
        except OSError as exc:
            sock.close()
            for other in held:
                other.close()
            raise SimError(
                f"zmq.error.ZMQError: {exc.strerror} (addr='tcp://{bind_host}:{port}'): Mooncake "
                f"handshake port of DP rank {core.rank}, TP worker {port - base}"
            ) from None
        held.append(sock)
    return held


def main() -> None:
    sys.exit(run(sys.argv[1:], dict(os.environ)))


if __name__ == "__main__":
    main()
