#!/usr/bin/env python3
"""Bad input as a new user types it (issue 27): the sixth held-out corpus, 170 cases of inventories, topology files,
`topology import` recipes, every command's flags and the documented environment variables. It was written by
someone who had not seen the fixes it measures (kimictl had been fixed against corpora 1-5, which live outside the
repository), then kept here so the figure can be reproduced; from now on it is no longer held out.

Each case runs through the real CLI ($KIMICTL_BIN, default this checkout's .venv/bin/kimictl), one command at a
time, every invocation under `timeout`, with KIMICTL_STATE_DIR and HOME under $KIMICTL_CORPUS_DIR (default
/tmp/kimictl-corpus6). A case is HANDLED when
  expect "reject": every command exits 2, prints no "Traceback", takes at most 10 s, and its output names the file
                   (or the flag / environment variable) and every `names` substring (key/field, host);
  expect "accept": a valid (unusual) input: every command exits 0, no traceback, <= 10 s (and `verify` holds);
  expect "either": one of the two, where refusing clearly and accepting are both right (`why` says why).
Remote commands point at 127.0.0.x port 9 (closed: contacting a host gives exit 1) or at a fabricated recorded
deploy: a refusal must come before any host is contacted. The recipe cases need vllm-ascend 0.23.0.post1's source
distribution in ~/.cache/kimictl/upstream/ (the unit tests fetch it).

Run:      .venv/bin/python bench/bad_input_corpus6.py             all cases (~3 min): the summary, every unhandled case
          .venv/bin/python bench/bad_input_corpus6.py ID [ID ...]  only those, verbose
          .venv/bin/python bench/bad_input_corpus6.py --list       the case ids and inputs
"""


from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = Path(os.environ.get("KIMICTL_CORPUS_DIR", "/tmp/kimictl-corpus6"))
KIMICTL = os.environ.get("KIMICTL_BIN", str(REPO / ".venv/bin/kimictl"))
# the source tree the fabricated deploy record is made with (the same kimictl the wrapper runs)
SRC = os.environ.get("KIMICTL_SRC", str(REPO))
VENV_PY = sys.executable   # run this with the interpreter kimictl is installed in (its fixtures import kimictl)
CASES_DIR = ROOT / "cases"
STATE = ROOT / "state"
HOME = ROOT / "home"
FIX = ROOT / "fixtures"
TIMEOUT = 30          # `timeout` on every invocation
LIMIT_S = 10.0        # a run over this is a hang (not handled)
CAP = 20_000         # stdout/stderr kept per run (results.json stays small)
RECIPE_SRC = Path.home() / ".cache/kimictl/upstream/vllm_ascend-0.23.0.post1/vllm_ascend-0.23.0.post1/tests/e2e/" \
                             "weekly/multi_node/external_dp/config/Kimi-K2.5-W4A8-16k-1k-TPOT50.yaml"
RECIPE = FIX / "recipe-k25.yaml"
LANE_PD = str(REPO / "tests/real_engine/topologies/cpu-smoke-pd.yml")

# ------------------------------------------------------------------------------------------------------------------
# builders (raw YAML text, so odd YAML can be written on purpose)
# ------------------------------------------------------------------------------------------------------------------

BASE_VARS = {"kimi_cluster": "kimi-c6", "kimi_model_dir": "/data/models/Kimi-K2.5-W4A8", "kimi_nic": "eth0"}
BASE_P = {"ansible_host": "10.0.0.1", "kimi_hardware": "atlas-800-a3"}
BASE_D = {"ansible_host": "10.0.0.2", "kimi_hardware": "atlas-800-a3"}


def ips(prefix: str, n: int = 16) -> str:
    return "[" + ", ".join(f"{prefix}{i}" for i in range(1, n + 1)) + "]"


def _merge(base: dict, over: dict | None) -> dict:
    out = dict(base)
    for k, v in (over or {}).items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def _lines(d: dict, indent: int) -> list[str]:
    pad = " " * indent
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out.append(f"{pad}{k}:")
            out += _lines(v, indent + 2)
        elif v == "":
            out.append(f"{pad}{k}:")
        else:
            out.append(f"{pad}{k}: {v}")
    return out


def inv(v: dict | None = None, p: dict | None = None, d: dict | None = None, hosts_extra: dict | None = None,
        tail: dict | None = None) -> str:
    """The base 2 x A3 inventory (hosts a3-p, a3-d) with raw YAML values changed (None drops a key)."""
    lines = ["all:", "  vars:", *_lines(_merge(BASE_VARS, v), 4)]
    lines += ["  hosts:", "    a3-p:", *_lines(_merge(BASE_P, p), 6), "    a3-d:", *_lines(_merge(BASE_D, d), 6)]
    if hosts_extra:
        lines += _lines(hosts_extra, 4)
    if tail:
        lines += _lines(tail, 2)
    return "\n".join(lines) + "\n"


BASE_INV = inv()

BASE_TOP = {"name": "c6-pd", "description": "corpus6 topology", "hardware": "atlas-800-a3", "mode": "pd",
            "launch": "external-dp", "ports": "{http_base: 7100, rpc: 12321}", "proxy": "{port: 8000}",
            "serve": {"enable-expert-parallel": "true", "max-model-len": "32768"}}
BASE_PRE = {"nodes": "1", "dp": "2", "tp": "8", "env": '{HCCL_BUFFSIZE: "512"}'}
BASE_DEC = {"nodes": "1", "dp": "4", "tp": "4", "env": '{HCCL_BUFFSIZE: "1024"}'}
BASE_SPEC = "{method: eagle3, model_id: lightseekorg/kimi-k2.5-eagle3, num_speculative_tokens: {decode: 3}}"


def topo(top: dict | None = None, pre: dict | None = None, dec: dict | None = None, spec: str | None = BASE_SPEC,
         tail: str = "") -> str:
    lines = _lines(_merge(BASE_TOP, top), 0)
    lines += ["roles:", "  prefill:", *_lines(_merge(BASE_PRE, pre), 4)]
    lines += ["  decode:", *_lines(_merge(BASE_DEC, dec), 4)]
    if spec is not None:
        lines.append(f"speculative: {spec}")
    return "\n".join(lines) + "\n" + tail


BASE_TOPO = topo()

STATIC = [["validate", "-i", "{INV}", "--topology", "{TOPO}"],
          ["plan", "-i", "{INV}", "--topology", "{TOPO}"],
          ["render", "-i", "{INV}", "--topology", "{TOPO}", "--output", "json"]]

REMOTE_INV = str(FIX / "remote-inv.yml")     # hosts on 127.0.0.71/.72 port 9 (closed); hub on 127.0.0.1:9
RO_INV = str(FIX / "rollout-inv.yml")        # 4 hosts (2P2D); a fabricated recorded a3-pd deploy of it is in STATE
NODEPLOY_INV = str(FIX / "nodeploy-inv.yml")  # valid, never deployed
DAMAGED_INV = str(FIX / "damaged-inv.yml")    # its current.json in STATE is not JSON


def rollout(*sets: str, extra: tuple[str, ...] = ()) -> list[list[str]]:
    args = ["rollout", "-i", RO_INV, "--check", *extra]
    for s in sets:
        args += ["--set", s]
    return [args]


C: list[dict] = []


def case(id: str, what: str, **kw) -> None:
    kw.setdefault("expect", "reject")
    C.append({"id": id, "what": what, **kw})


def icase(id: str, what: str, text, names=(), topology: str = "a3-pd", **kw) -> None:
    """An inventory file case (validate, plan, render --output json) with a preset topology."""
    kw.setdefault("file", "inv")
    case(id, what, inv=text, topo=topology, names=list(names), **kw)


def tcase(id: str, what: str, text, names=(), inventory: str = BASE_INV, **kw) -> None:
    """A topology file case with a valid 2 x A3 inventory."""
    kw.setdefault("file", "topo")
    case(id, what, inv=inventory, topo=text, names=list(names), **kw)


IPS_P = ips("10.20.0.")
IPS_D = ips("10.20.1.")



def recipe(old: str = "", new: str = "") -> str:
    text = RECIPE_SRC.read_text() if RECIPE_SRC.exists() else ""
    return text.replace(old, new) if old else text


def imp(*extra: str, recipe_path: str = "{D}/recipe.yaml") -> list[list[str]]:
    return [["topology", "import", recipe_path, *extra], ["topology", "import", recipe_path, *extra, "-o", "json"]]


def rcase(id: str, what: str, text: str, names=(), extra=(), **kw) -> None:
    kw.setdefault("file", "{D}/recipe.yaml")
    case(id, what, cmds=imp(*extra), files=[("recipe.yaml", "file", text, 0o644)], names=list(names), **kw)

# ==================================================================================================================
# helpers of corpus 5
# ==================================================================================================================
KH = HOME / "known_hosts"
RBASE = ("all:\n  vars:\n    kimi_cluster: {c}\n    kimi_model_dir: /data/models/Kimi-K2.5-W4A8\n"
         "    kimi_model_endpoint: http://127.0.0.1:9\n    kimi_nic: eth0\n    ansible_port: 9\n"
         "    ansible_ssh_common_args: -o UserKnownHostsFile=" + str(KH) + "\n{extra}  hosts:\n"
         "    {p}-p: {{ansible_host: {a}, kimi_hardware: atlas-800-a3}}\n"
         "    {p}-d: {{ansible_host: {b}, kimi_hardware: atlas-800-a3}}\n")


def rinv(extra: str = "") -> str:
    """A never-deployed inventory on closed hosts 127.0.0.91/.92 (cluster kimi-c5rk) with extra all.vars lines."""
    return RBASE.format(c="kimi-c5rk", p="rk", a="127.0.0.91", b="127.0.0.92", extra=extra)


def roinv(extra: str = "") -> str:
    """The recorded cluster kimi-c5ro's inventory (same hosts as RO_INV) with extra all.vars lines."""
    return RBASE.format(c="kimi-c5ro", p="ro", a="127.0.0.73", b="127.0.0.74", extra=extra) + \
        "    ro-p2: {ansible_host: 127.0.0.83, kimi_hardware: atlas-800-a3}\n" \
        "    ro-d2: {ansible_host: 127.0.0.84, kimi_hardware: atlas-800-a3}\n"


KEY = [("key", "file", "sk-corpus5-client-1\n", 0o600)]
def keyfile(name: str, content, mode: int = 0o600, kind: str = "file"):
    return (name, kind, content, mode)


A2_HOSTS = {f"a2-{i}": f"{{ansible_host: 10.0.1.{i}, kimi_hardware: atlas-800-a2}}" for i in range(1, 5)}
A2_INV = inv(hosts_extra=A2_HOSTS).replace(
    "    a3-p:\n      ansible_host: 10.0.0.1\n      kimi_hardware: atlas-800-a3\n"
    "    a3-d:\n      ansible_host: 10.0.0.2\n      kimi_hardware: atlas-800-a3\n", "")
SPEC_NONE = None
DEPLOY_YES = ["deploy", "-i", "{INV}", "-t", "a3-pd", "--yes", "--skip-preflight", "corpus5"]
ROLL_YES = ["rollout", "-i", RO_INV, "--set", "decode.serve.max-num-seqs=16", "--yes"]
V = dict(expect="accept", file=None)
R = ["render", "-i", "{INV}", "-t", "{TOPO}"]
OBS = ["observe", "render", "-i", "{INV}", "-t", "{TOPO}"]


# ==================================================================================================================
# helpers of corpus 5
# ==================================================================================================================
OK = dict(expect="accept", file=None)
SB = ["sandbox", "up", "-d", "{D}/sb"]          # a sandbox dir inside the case dir (never the default)


def emit(id, what, text, names=(), **kw):
    """An inventory case run through validate only (cheap) plus plan."""
    icase(id, what, text, names=names, **kw)


# ==================================================================================================================
# corpus 6 cases. A. inventory: cluster-wide keys
# ==================================================================================================================
icase("cluster-underscore", "kimi_cluster: kimi_c6 (an underscore)", inv(v={"kimi_cluster": "kimi_c6"}),
      names=["kimi_cluster"])
icase("cluster-leading-dash", "kimi_cluster: -kimi (leading dash)", inv(v={"kimi_cluster": "'-kimi'"}),
      names=["kimi_cluster"])
icase("cluster-slash", "kimi_cluster: prod/kimi (a path-like name)", inv(v={"kimi_cluster": "prod/kimi"}),
      names=["kimi_cluster"])
icase("ok-cluster-single-char", "kimi_cluster: k (one character)", inv(v={"kimi_cluster": "k"}), **OK,
      why="README: [a-z0-9][a-z0-9-]{0,62}")
icase("model-dir-env-var", "kimi_model_dir: $HOME/models/kimi (a shell variable)",
      inv(v={"kimi_model_dir": "$HOME/models/kimi"}), names=["kimi_model_dir"])
icase("model-dir-missing", "no kimi_model_dir at all (required)", inv(v={"kimi_model_dir": None}),
      names=["kimi_model_dir"])
icase("ok-model-dir-deep", "kimi_model_dir: /mnt/nfs/share-01/models/Kimi-K2.5-W4A8_v2",
      inv(v={"kimi_model_dir": "/mnt/nfs/share-01/models/Kimi-K2.5-W4A8_v2"}), **OK, why="an ordinary absolute path")
icase("model-source-url", "kimi_model_source: https://modelscope.cn (a URL instead of the hub name)",
      inv(v={"kimi_model_source": "https://modelscope.cn"}), names=["kimi_model_source"])
icase("model-id-trailing-slash", "kimi_model_id: Eco-Tech/Kimi-K2.5-W4A8/ (trailing slash)",
      inv(v={"kimi_model_id": "Eco-Tech/Kimi-K2.5-W4A8/"}), names=["kimi_model_id"])
icase("model-id-no-owner", "kimi_model_id: Kimi-K2.5-W4A8 (no owner/)", inv(v={"kimi_model_id": "Kimi-K2.5-W4A8"}),
      names=["kimi_model_id"])
icase("endpoint-port-word", "kimi_model_endpoint: http://mirror.example.com:port",
      inv(v={"kimi_model_endpoint": "http://mirror.example.com:port"}), names=["kimi_model_endpoint"])
icase("ok-endpoint-localhost", "kimi_model_endpoint: http://localhost:8080/",
      inv(v={"kimi_model_endpoint": "http://localhost:8080/"}), **OK, why="a local mirror URL")
icase("revision-float", "kimi_model_revision: 1.10 (YAML float 1.1)", inv(v={"kimi_model_revision": "1.10"}),
      names=["kimi_model_revision"], expect="either",
      why="YAML turns 1.10 into 1.1: refusing naming the key is right; taking the string '1.1' is tolerable")
icase("version-float", "kimi_vllm_ascend_version: 0.23 (YAML float, too short)",
      inv(v={"kimi_vllm_ascend_version": "0.23"}), names=["kimi_vllm_ascend_version"])
icase("version-unknown-future", "kimi_vllm_ascend_version: 9.0.0 (no such profile)",
      inv(v={"kimi_vllm_ascend_version": "9.0.0"}), names=["kimi_vllm_ascend_version"])
icase("runtime-bool", "kimi_runtime: true", inv(v={"kimi_runtime": "true"}), names=["kimi_runtime"])
icase("ok-runtime-host", "kimi_runtime: host with kimi_proxy_script (README: required there)",
      inv(v={"kimi_runtime": "host", "kimi_proxy_script": "/opt/vllm-ascend/examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py"}), **OK, why="documented value with its documented companion key")
icase("image-repo-uppercase-path", "kimi_image_repo: Registry.example.com/Ascend/VLLM (upper case path)",
      inv(v={"kimi_image_repo": "registry.example.com/Ascend/VLLM"}), names=["kimi_image_repo"])
icase("ok-proxy-host-explicit", "kimi_proxy_host: a3-p (the default spelled out)", inv(v={"kimi_proxy_host": "a3-p"}),
      **OK, why="documented")
icase("monitor-host-case", "kimi_monitor_host: A3-D (case of a host name)", inv(v={"kimi_monitor_host": "A3-D"}),
      names=["kimi_monitor_host"])
icase("api-key-is-dir", "kimi_api_key_file: a directory", inv(v={"kimi_api_key_file": "{D}/kd"}),
      files=[("kd", "dir", None, 0o700)], names=["kimi_api_key_file"])
icase("ok-draft-dir-abs", "kimi_draft_model_dir: /data/models/kimi-k2.5-eagle3",
      inv(v={"kimi_draft_model_dir": "/data/models/kimi-k2.5-eagle3"}), **OK, why="documented: enables the draft")
icase("ok-python-versioned", "kimi_python: python3.11", inv(v={"kimi_python": "python3.11"}), **OK,
      why="a versioned interpreter name like the default python3")
icase("engine-profile-upper", "kimi_engine_profile: Ascend", inv(v={"kimi_engine_profile": "Ascend"}),
      names=["kimi_engine_profile"])
icase("kv-connector-nixl-ascend", "kimi_kv_connector: nixl with the ascend profile",
      inv(v={"kimi_kv_connector": "nixl"}), names=["kimi_kv_connector"])
icase("unknown-kimi-key-cluster", "kimi_max_model_len: 32768 in all.vars (a topology setting)",
      inv(v={"kimi_max_model_len": "32768"}), names=["kimi_max_model_len"])
icase("ok-ansible-vars-extra", "ansible_user: ubuntu, ansible_become: true in all.vars",
      inv(v={"ansible_user": "ubuntu", "ansible_become": "true"}), **OK, why="ordinary Ansible variables")

# ==================================================================================================================
# B. inventory: host keys
# ==================================================================================================================
icase("ansible-host-three-octets", "ansible_host: 10.0.0 (three octets) on a3-d", inv(d={"ansible_host": "10.0.0"}),
      names=["ansible_host", "a3-d"], expect="either",
      why="'10.0.0' is a plausible but broken IP; as a DNS name it would not resolve: refusing naming it is right, "
          "accepting a name is tolerable statically")
icase("ansible-host-ipv6-zone", "ansible_host: 'fe80::1%eth0' (link-local with a zone)",
      inv(d={"ansible_host": "'fe80::1%eth0'"}), names=["ansible_host", "a3-d"], expect="either",
      why="a link-local address cannot carry the cluster's traffic: refuse naming it, or accept an IPv6 literal")
icase("ansible-host-trailing-dot-ip", "ansible_host: '10.0.0.2.' (trailing dot)", inv(d={"ansible_host": "10.0.0.2."}),
      names=["ansible_host", "a3-d"])
icase("hardware-short", "kimi_hardware: a3 (short form) on a3-p", inv(p={"kimi_hardware": "a3"}),
      names=["kimi_hardware", "a3-p"])
icase("hardware-800i", "kimi_hardware: atlas-800i-a2 (the inference box) on a3-d", inv(d={"kimi_hardware": "atlas-800i-a2"}),
      names=["kimi_hardware", "a3-d"])
icase("role-abbrev", "kimi_role: p on a3-p", inv(p={"kimi_role": "p"}), names=["kimi_role", "a3-p"])
icase("role-both-decode", "kimi_role: decode on both hosts of a3-pd (no prefill host)",
      inv(p={"kimi_role": "decode"}, d={"kimi_role": "decode"}), names=["prefill"], file="files")
icase("ok-role-explicit", "kimi_role: prefill on a3-p, decode on a3-d",
      inv(p={"kimi_role": "prefill"}, d={"kimi_role": "decode"}), **OK,
      verify=("roles", {"a3-p": "prefill", "a3-d": "decode"}), why="documented")
icase("device-ips-15", "kimi_device_ips: 15 entries on an A3 host (16 NPUs)", inv(p={"kimi_device_ips": ips("10.20.0.", 15)}),
      names=["kimi_device_ips", "a3-p"])
icase("device-ips-comma-string", "kimi_device_ips: '10.20.0.1,10.20.0.2,...' (one string)",
      inv(p={"kimi_device_ips": "'" + ",".join(f"10.20.0.{i}" for i in range(1, 17)) + "'"}),
      names=["kimi_device_ips", "a3-p"])
icase("host-ip-hostname-space", "kimi_host_ip: '10.0.0.1 10.0.0.3' (two addresses)",
      inv(p={"kimi_host_ip": "'10.0.0.1 10.0.0.3'"}), names=["kimi_host_ip", "a3-p"])
icase("state-dir-root", "kimi_state_dir: / on a3-d", inv(d={"kimi_state_dir": "/"}), names=["kimi_state_dir", "a3-d"],
      expect="either", why="the state directory '/' would scatter releases over the root: refusing is right; "
                           "README only asks for an absolute path")
icase("ok-state-dir-opt", "kimi_state_dir: /opt/kimi/state on both", inv(v={"kimi_state_dir": "/opt/kimi/state"}), **OK,
      why="an absolute path")
icase("nic-space-inside", "kimi_nic: 'eth 0' on a3-p", inv(p={"kimi_nic": "'eth 0'"}), names=["kimi_nic", "a3-p"])
icase("nic-wildcard", "kimi_nic: 'eth*' on a3-d", inv(d={"kimi_nic": "'eth*'"}), names=["kimi_nic", "a3-d"])
icase("engine-command-relative", "kimi_engine_command: vllm-custom (no path) on a3-p",
      inv(p={"kimi_engine_command": "vllm-custom"}), names=["kimi_engine_command"], expect="either",
      why="a program on PATH is plausible; refusing naming the key is also fine")
icase("host-unknown-kimi-key", "kimi_npus: 16 on a3-p (no such key)", inv(p={"kimi_npus": "16"}),
      names=["kimi_npus", "a3-p"])
icase("hosts-empty", "all.hosts: {} (no hosts)", inv().split("  hosts:")[0] + "  hosts: {}\n", names=["hosts"],
      file="files")
icase("ok-hostname-digits", "host names node01/node02", inv().replace("a3-p:", "node01:").replace("a3-d:", "node02:"),
      **OK, why="ordinary host names")
icase("ok-host-flow-style", "each host as a flow mapping {ansible_host: ..., kimi_hardware: ...}",
      "all:\n  vars: {kimi_cluster: kimi-c6, kimi_model_dir: /data/models/Kimi-K2.5-W4A8, kimi_nic: eth0}\n  hosts:\n"
      "    a3-p: {ansible_host: 10.0.0.1, kimi_hardware: atlas-800-a3}\n"
      "    a3-d: {ansible_host: 10.0.0.2, kimi_hardware: atlas-800-a3}\n", **OK, why="YAML flow style")
icase("inv-third-host-idle", "a third A3 host with a3-pd (1P1D): spare host", inv(hosts_extra={
    "a3-x": "{ansible_host: 10.0.0.3, kimi_hardware: atlas-800-a3}"}), expect="either", file="files", names=["a3-x"],
      why="a spare host: using it (share) or refusing naming it are both clear")
icase("inv-a2-host-with-a3-topo", "an A2 host among A3 hosts with a3-pd", inv(d={"kimi_hardware": "atlas-800-a2"}),
      names=["a3-d"], file="files")

# ==================================================================================================================
# C. topology files
# ==================================================================================================================
tcase("topo-name-65", "name: 65 characters", topo(top={"name": "a" * 65}), names=["name"])
tcase("topo-name-missing", "no name:", topo(top={"name": None}), names=["name"], expect="either",
      why="a file's name could default to its file name; refusing naming 'name' is right too")
tcase("topo-mode-missing", "no mode:", topo(top={"mode": None}), names=["mode"])
tcase("topo-hardware-a2-a3-inv", "hardware: atlas-800-a2 with an A3 inventory", topo(top={"hardware": "atlas-800-a2"}),
      names=["hardware"], file="files")
tcase("topo-share-negative", "share: {decode: -1}", topo(top={"share": "{decode: -1}"}), names=["share"])
tcase("topo-http-base-float", "ports.http_base: 7100.5", topo(top={"ports": "{http_base: 7100.5, rpc: 12321}"}),
      names=["http_base"])
tcase("topo-rpc-proto-suffix", "ports.rpc: 12321/tcp", topo(top={"ports": "{http_base: 7100, rpc: 12321/tcp}"}),
      names=["rpc"])
tcase("topo-kv-base-65001", "ports.kv_base: 65001", topo(top={"ports": "{http_base: 7100, rpc: 12321, kv_base: 65001}"}),
      names=["kv_base"])
tcase("ok-topo-kv-base-40000", "ports.kv_base: 40000", topo(top={"ports": "{http_base: 7100, rpc: 12321, kv_base: 40000}"}),
      **OK, why="within range, above the A3 minimum")
tcase("ok-topo-no-ports", "no ports: (defaults)", topo(top={"ports": None}), **OK, why="ports has defaults")
tcase("topo-engine-bind-bool", "engine_bind: true", topo(top={"engine_bind": "true"}), names=["engine_bind"])
tcase("topo-proxy-port-443", "proxy.port: 443", topo(top={"proxy": "{port: 443}"}), names=["port"])
tcase("topo-proxy-routers-5", "proxy.routers: 5 (max 4)", topo(top={"proxy": "{port: 8000, routers: 5}"}),
      names=["routers"])
tcase("topo-proxy-router-base-low", "proxy.router_port_base: 80", topo(top={"proxy": "{port: 8000, router_port_base: 80}"}),
      names=["router_port_base"])
tcase("topo-proxy-header-zero", "proxy.header_timeout_s: 0", topo(top={"proxy": "{port: 8000, header_timeout_s: 0}"}),
      names=["header_timeout_s"])
tcase("topo-proxy-max-conn-huge", "proxy.max_connections: 100000", topo(top={"proxy": "{port: 8000, max_connections: 100000}"}),
      names=["max_connections"])
tcase("ok-topo-proxy-defaults", "proxy: {} (all defaults)", topo(top={"proxy": "{}"}), **OK, why="every field has a default")
tcase("topo-env-top-list", "env: [HCCL_BUFFSIZE=512] at the top", topo(top={"env": "[HCCL_BUFFSIZE=512]"}), names=["env"])
tcase("topo-serve-top-list", "serve: a list of '--flag value' strings", topo(top={"serve": "['--max-num-seqs 16']"}),
      names=["serve"])
tcase("topo-dp-word", "roles.decode.dp: four", topo(dec={"dp": "four"}), names=["dp"])
tcase("topo-tp-float", "roles.prefill.tp: 8.5", topo(pre={"tp": "8.5"}), names=["tp"])
tcase("topo-nodes-negative", "roles.decode.nodes: -1", topo(dec={"nodes": "-1"}), names=["nodes"])
tcase("topo-role-colocated-in-pd", "mode pd with roles prefill, decode and colocated",
      topo().replace("roles:\n", "roles:\n  colocated: {nodes: 1, dp: 4, tp: 4}\n"), names=["colocated"])
tcase("topo-spec-tokens-zero", "speculative.num_speculative_tokens: {decode: 0}",
      topo(spec="{method: eagle3, model_id: lightseekorg/kimi-k2.5-eagle3, num_speculative_tokens: {decode: 0}}"),
      names=["num_speculative_tokens"])
tcase("topo-spec-method-mtp", "speculative.method: mtp", topo(spec="{method: mtp, model_id: lightseekorg/kimi-k2.5-eagle3}"),
      names=["method"])
tcase("topo-spec-list", "speculative: [eagle3]", topo(spec="[eagle3]"), names=["speculative"])
tcase("ok-topo-no-speculative", "no speculative:", topo(spec=None), **OK, why="speculative is optional")
tcase("topo-slo-tpot-units", "slo.tpot_ms: 50ms", topo(top={"slo": "{tpot_ms: 50ms}"}), names=["tpot_ms"])
tcase("ok-topo-slo-full", "slo: {tpot_ms: 50, ttft_ms: 2000, quantile: 0.99}",
      topo(top={"slo": "{tpot_ms: 50, ttft_ms: 2000, quantile: 0.99}"}), **OK, why="documented fields")
tcase("topo-heal-hang-units", "heal.hang_deadline_s: 2m", topo(top={"heal": "{hang_deadline_s: 2m}"}),
      names=["hang_deadline_s"])
tcase("ok-topo-heal-full", "heal: {hang_deadline_s: 120, max_actions: 3, window_s: 600}",
      topo(top={"heal": "{hang_deadline_s: 120, max_actions: 3, window_s: 600}"}), **OK, why="documented fields")
tcase("topo-top-typo-port", "'port:' instead of 'ports:' at the top", topo(top={"port": "{http_base: 7100}"}),
      names=["port"])
tcase("ok-topo-serve-dict-value", "serve: {compilation-config: {cudagraph_mode: FULL_DECODE_ONLY}}",
      topo(dec={"serve": "{compilation-config: {cudagraph_mode: FULL_DECODE_ONLY}}"}), **OK,
      why="schema: a serve value may be a mapping (JSON flag)")
tcase("ok-topo-internal-dp-colocated", "a3 colocated topology with launch: internal-dp",
      "name: c6-col\ndescription: c6\nhardware: atlas-800-a3\nmode: colocated\nlaunch: internal-dp\n"
      "serve: {enable-expert-parallel: true}\nroles:\n  colocated: {nodes: 1, dp: 4, tp: 4}\n", **OK, why="documented launch value",
      inventory=inv(hosts_extra=None).replace("    a3-d:\n      ansible_host: 10.0.0.2\n      kimi_hardware: atlas-800-a3\n", ""))
case("topo-empty-file", "an empty topology file (t.yml, 0 bytes)", inv=BASE_INV, topo=None,
     files=[("t.yml", "file", "", 0o644)], cmds=[["validate", "-i", "{INV}", "-t", "{D}/t.yml"],
                                          ["plan", "-i", "{INV}", "-t", "{D}/t.yml"]], file="{D}/t.yml")
tcase("topo-only-name", "a topology with only name: and description:", "name: c6-x\ndescription: x\n", names=["mode"])

# ==================================================================================================================
# D. topology import recipes
# ==================================================================================================================
rcase("import-port-start-huge", "recipe port_start: 99999 on node 0",
      recipe("    port_start: 7100\n    dp_rpc_port: 12321\n    dp_size: 2\n", "    port_start: 99999\n"
             "    dp_rpc_port: 12321\n    dp_size: 2\n"), names=["port_start"])
rcase("import-no-routing", "recipe without routing:", recipe(
    'routing:\n  type: "disaggregated_prefill"\n  groups:\n    prefiller: [ 0, 1 ]\n    decoder: [ 2, 3 ]\n', ""),
      names=["routing"])
rcase("import-node-index-negative", "recipe config node_index: -1", recipe("  - node_index: 3\n    port_start",
                                                                          "  - node_index: -1\n    port_start"),
      names=["node_index"])
rcase("import-kv-transfer-broken-json", "recipe node 0 kv-transfer-config with a double comma (broken JSON)",
      recipe('"kv_port": "30000", "engine_id": "0",', '"kv_port": "30000",, "engine_id": "0",'),
      names=["kv-transfer-config"])
rcase("import-spec-tokens-zero", "recipe speculative-config num_speculative_tokens: 0",
      recipe('"num_speculative_tokens": 3}', '"num_speculative_tokens": 0}'), names=["num_speculative_tokens"])
rcase("import-tab-indent", "recipe with a tab indenting node 0's dp_size", recipe("    dp_size: 2\n", "\tdp_size: 2\n", ),
      names=[])
rcase("import-env-int", "recipe env_decode HCCL_BUFFSIZE: 1800 (unquoted int)",
      recipe('  HCCL_BUFFSIZE: "1800"', "  HCCL_BUFFSIZE: 1800"), names=["HCCL_BUFFSIZE"], expect="either",
      why="an int env value: taking it as the string '1800' is right, refusing naming it tolerable")
rcase("ok-import-no-test-name", "recipe without test_name", recipe('test_name: "multi-node-kimi-k2.5-w4a8-ep-16k-1k-TPOT50"\n', ""),
      expect="accept", file=None, why="--name defaults to the file name")
rcase("ok-import-no-benchmarks", "recipe without its 'benchmarks:' section",
      recipe().split("\nbenchmarks:")[0] + "\n", expect="accept", file=None,
      why="the benchmark section is upstream's test harness; a topology does not need it")
rcase("import-decoder-index-string", "recipe routing.groups.decoder: ['2', '3'] (strings)",
      recipe("    decoder: [ 2, 3 ]", "    decoder: [ '2', '3' ]"), names=["decoder"], expect="either",
      why="strings for node indices: refusing naming decoder is right; coercing is tolerable")
rcase("import-template-missing-node", "recipe templates without node 3",
      recipe().split("  - node_index: 3\n    envs:")[0] if "  - node_index: 3\n    envs:" in recipe() else recipe(),
      names=["3"])
case("ok-import-json-recipe", "topology import of the recipe written as JSON (recipe.json)",
     files=[("recipe.json", "file", json.dumps(__import__("yaml").safe_load(recipe())) if recipe() else "{}", 0o644)],
     cmds=[["topology", "import", "{D}/recipe.json", "--name", "c6-json"]], **OK, why="JSON is YAML")
case("import-missing-file-typo", "topology import recipe.yml when the file is recipe.yaml",
     files=[("recipe.yaml", "file", recipe(), 0o644)], cmds=[["topology", "import", "{D}/recipe.yml"]],
     file="{D}/recipe.yml")
case("import-version-empty", "topology import R --version ''", files=[("recipe.yaml", "file", recipe(), 0o644)],
     cmds=[["topology", "import", "{D}/recipe.yaml", "--version", ""]], file="--version")
case("import-version-v-prefix", "topology import R --version v0.23.0", files=[("recipe.yaml", "file", recipe(), 0o644)],
     cmds=[["topology", "import", "{D}/recipe.yaml", "--version", "v0.23.0"]], file="--version",
     names=["v0.23.0"], expect="either", why="'v' spelling: refusing naming it right; accepting as 0.23.0 tolerable")
case("import-name-dot-yaml", "topology import R --name c6.yml? no: --name 'C6 Import'",
     files=[("recipe.yaml", "file", recipe(), 0o644)],
     cmds=[["topology", "import", "{D}/recipe.yaml", "--name", "C6 Import"]], file="--name", names=["C6 Import"])
case("import-filename-spaces", "topology import 'My Recipe (copy).yaml' (name from the file name)",
     files=[("My Recipe (copy).yaml", "file", recipe(), 0o644)],
     cmds=[["topology", "import", "{D}/My Recipe (copy).yaml"]], file="{D}/My Recipe (copy).yaml", expect="either",
     why="a name derived from the file must be valid: accept with a cleaned name, or refuse saying use --name")
case("import-out-existing", "topology import R --out an existing topology file", files=[
    ("recipe.yaml", "file", recipe(), 0o644), ("t.yml", "file", BASE_TOPO, 0o644)],
     cmds=[["topology", "import", "{D}/recipe.yaml", "--out", "{D}/t.yml"]], file="{D}/t.yml", expect="either",
     why="overwriting a file the user asked for is ordinary; refusing naming it is tolerable")
case("import-output-bogus", "topology import R -o txt", files=[("recipe.yaml", "file", recipe(), 0o644)],
     cmds=[["topology", "import", "{D}/recipe.yaml", "-o", "txt"]], file="txt")
case("import-recipe-is-preset-name", "topology import a3-pd (a preset name, not a recipe file)",
     cmds=[["topology", "import", "a3-pd"]], file="a3-pd")

# ==================================================================================================================
# E. static command flags
# ==================================================================================================================
V6 = ["validate", "-i", "{INV}", "-t", "a3-pd"]
case("cli-topology-underscore-preset", "validate -t a3_pd (underscore)", inv=BASE_INV, topo="a3-pd",
     cmds=[["validate", "-i", "{INV}", "-t", "a3_pd"]], file="a3_pd")
case("cli-topology-2p1d-short", "validate -t a3-2p1d (a preset name guessed)", inv=BASE_INV, topo="a3-pd",
     cmds=[["validate", "-i", "{INV}", "-t", "a3-2p1d"]], file="a3-2p1d")
case("cli-validate-output-short-j", "validate -o j (abbreviation)", inv=BASE_INV, topo="a3-pd",
     cmds=[[*V6, "-o", "j"]], file="j")
case("ok-validate-json", "validate -o json", inv=BASE_INV, topo="a3-pd", cmds=[[*V6, "-o", "json"]], **OK,
     why="documented")
case("ok-plan-json", "plan -o json", inv=BASE_INV, topo="a3-pd", cmds=[["plan", "-i", "{INV}", "-t", "a3-pd", "-o", "json"]],
     **OK, why="documented")
case("cli-plan-inventory-is-topology", "plan -i the topology file, -t the inventory file (swapped)", inv=BASE_INV,
     topo=BASE_TOPO, cmds=[["plan", "-i", "{TOPO}", "-t", "{INV}"]], file="files")
case("cli-render-out-under-file", "render --out inv.yml/out (below a regular file)", inv=BASE_INV, topo="a3-pd",
     cmds=[[*R, "--out", "{D}/inv.yml/out"]], file="--out", names=[], expect="reject")
case("ok-render-out-new", "render --out a new directory", inv=BASE_INV, topo="a3-pd", cmds=[[*R, "--out", "{D}/r"]],
     **OK, verify=("exists", "{D}/r/render.json"), why="documented")
case("cli-render-out-no-perm", "render --out a directory mode 0500 (not writable)", inv=BASE_INV, topo="a3-pd",
     files=[("ro", "dir", None, 0o500)], cmds=[[*R, "--out", "{D}/ro/x"]], file="{D}/ro",
     expect="either", accept_rc=(1,),
     why="README: an unwritable directory is exit 1 with its path; exit 2 naming it also fine (root may write)")
case("cli-schema-plural", "schema inventories", cmds=[["schema", "inventories"]], file="inventories")
case("cli-topologies-output-json-upper", "topologies -o JSON", cmds=[["topologies", "-o", "JSON"]], file="JSON",
     expect="either", why="case-insensitive choice is tolerable")
case("cli-validate-no-inventory-value", "validate -t a3-pd -i (no value at the end)", cmds=[["validate", "-t", "a3-pd", "-i"]],
     file="-i")
case("cli-observe-render-profile-prod", "observe render --profile production", inv=BASE_INV, topo="a3-pd",
     cmds=[[*OBS, "--out", "{D}/o", "--profile", "production"]], file="production")
case("ok-observe-render-prefix", "observe render --prefix /srv/prometheus/kimi", inv=BASE_INV, topo="a3-pd",
     cmds=[[*OBS, "--out", "{D}/o", "--prefix", "/srv/prometheus/kimi"]], **OK, why="documented")
case("cli-observe-render-out-is-inv", "observe render --out the inventory file", inv=BASE_INV, topo="a3-pd",
     cmds=[[*OBS, "--out", "{INV}"]], file="--out", names=[])

# ==================================================================================================================
# F. remote command flags (closed hosts / fabricated record): refusals before any host
# ==================================================================================================================
case("preflight-skip-check-upper", "preflight --skip-check NPU (check id case)",
     cmds=[["preflight", "-i", REMOTE_INV, "-t", "a3-pd", "--skip-check", "NPU"]], file="--skip-check", names=["NPU"])
case("deploy-ready-timeout-units", "deploy --check --ready-timeout 30m",
     cmds=[["deploy", "-i", REMOTE_INV, "-t", "a3-pd", "--check", "--ready-timeout", "30m"]], file="--ready-timeout")
case("deploy-wait-units", "deploy --yes --wait 5m", cmds=[["deploy", "-i", REMOTE_INV, "-t", "a3-pd", "--yes",
                                                            "--wait", "5m"]], file="--wait")
case("deploy-no-topology", "deploy -i INV --yes (no --topology)", cmds=[["deploy", "-i", REMOTE_INV, "--yes"]],
     file="--topology")
case("deploy-bad-inventory-yes", "deploy --yes with an inventory whose kimi_runtime: docker-ce",
     inv=rinv("    kimi_runtime: docker-ce\n"), cmds=[DEPLOY_YES], file="inv", names=["kimi_runtime"])
case("rollout-set-no-value", "rollout --check --set decode.serve.max-num-seqs= (empty value)",
     cmds=rollout("decode.serve.max-num-seqs="), file="--set", names=["max-num-seqs"], expect="either", accept_rc=(1,),
     why="VALUE is YAML: an empty value is null (removes the key, then --check reads closed hosts: 1), "
         "or a refusal naming it")
case("rollout-set-unknown-role", "rollout --check --set decoder.serve.max-num-seqs=16 (role typo)",
     cmds=rollout("decoder.serve.max-num-seqs=16"), file="--set", names=["decoder"])
case("rollout-set-spaces", "rollout --check --set 'decode.serve.max-num-seqs = 16' (spaces around =)",
     cmds=rollout("decode.serve.max-num-seqs = 16"), file="--set")
case("rollout-set-tp-nondivisor", "rollout --check --set decode.tp=6", cmds=rollout("decode.tp=6"), file="--set",
     names=["decode"])
case("rollout-set-mode", "rollout --check --set mode=colocated", cmds=rollout("mode=colocated"), file="--set",
     names=["mode"], expect="either", accept_rc=(1,),
     why="a mode change is not a rolling change: refusing naming mode is right; rc 1 after closed hosts tolerable")
case("rollout-drain-timeout-units", "rollout --check --drain-timeout 5m",
     cmds=rollout("decode.serve.max-num-seqs=16", extra=("--drain-timeout", "5m")), file="--drain-timeout")
case("rollout-router-no-scheme", "rollout --check --router 10.0.0.9:8000 (no scheme)",
     cmds=rollout("decode.serve.max-num-seqs=16", extra=("--router", "10.0.0.9:8000")), file="--router",
     names=["10.0.0.9:8000"])
case("rollout-topology-preset-a2", "rollout --check -t a2-pd on an A3 cluster",
     cmds=[["rollout", "-i", RO_INV, "--check", "-t", "a2-pd"]], file="a2-pd", names=[])
case("rollback-to-release-with-spaces", "rollback --to 'abc def' --yes",
     cmds=[["rollback", "-i", RO_INV, "--to", "abc def", "--yes"]], file=["--to", "release abc def"], names=["abc def"])
case("rollback-wait-units", "rollback --yes --wait 1h", cmds=[["rollback", "-i", RO_INV, "--yes", "--wait", "1h"]],
     file="--wait")
case("status-watch-units", "status --watch 5s", cmds=[["status", "-i", RO_INV, "--watch", "5s"]], file="--watch")
case("status-missing-inventory", "status -i a missing file", cmds=[["status", "-i", "{D}/nope.yml"]], file="{D}/nope.yml")
case("heal-interval-units", "heal --interval 30s", cmds=[["heal", "-i", RO_INV, "--interval", "30s"]], file="--interval")
case("heal-dry-run-max-actions-neg", "heal --dry-run --max-actions -1", cmds=[["heal", "-i", RO_INV, "--dry-run",
                                                                               "--max-actions", "-1"]],
     file="--max-actions")
case("bench-requests-huge", "bench --requests 1000000 (max 100000)", cmds=[["bench", "-i", RO_INV, "--requests", "1000000"]],
     file="--requests")
case("bench-concurrency-2048", "bench --concurrency 2048 (max 1024)", cmds=[["bench", "-i", RO_INV, "--concurrency", "2048"]],
     file="--concurrency")
case("bench-output-tokens-words", "bench --output-tokens 1k", cmds=[["bench", "-i", RO_INV, "--output-tokens", "1k"]],
     file="--output-tokens")
case("bench-timeout-units", "bench --timeout 5m", cmds=[["bench", "-i", RO_INV, "--timeout", "5m"]], file="--timeout")
case("logs-role-plural", "logs --role prefills", cmds=[["logs", "-i", RO_INV, "--role", "prefills"]], file="--role")
case("logs-host-ip", "logs --host 127.0.0.73 (an address)", cmds=[["logs", "-i", RO_INV, "--host", "127.0.0.73"]],
     file="--host", names=["127.0.0.73"])
case("logs-lines-huge-units", "logs -n 1k", cmds=[["logs", "-i", RO_INV, "-n", "1k"]], file="--lines")
case("logs-bundle-no-value", "logs --bundle (no file)", cmds=[["logs", "-i", RO_INV, "--bundle"]], file="--bundle")
case("logs-secrets-file-0644-is-fine", "logs --secrets-file a 0644 list with --bundle into a missing dir",
     files=[("s.txt", "file", "secret1\n", 0o644)],
     cmds=[["logs", "-i", RO_INV, "--secrets-file", "{D}/s.txt", "--bundle", "{D}/no/such/b.tar.gz"]],
     file="{D}/no/such", names=[])
case("start-wait-units", "start --yes --wait 30s", cmds=[["start", "-i", RO_INV, "--yes", "--wait", "30s"]],
     file="--wait")
case("start-ready-timeout-zero", "start --yes --ready-timeout 0", cmds=[["start", "-i", RO_INV, "--yes",
                                                                         "--ready-timeout", "0"]],
     file="--ready-timeout")
case("weights-pull-streams-negative", "weights pull --streams -2", cmds=[["weights", "pull", "-i", REMOTE_INV,
                                                                          "--streams", "-2"]], file="--streams")
case("weights-status-limit-role", "weights status --limit prefill (a role, not a host)",
     cmds=[["weights", "status", "-i", REMOTE_INV, "--limit", "prefill"]], file="--limit", names=["prefill"])
case("weights-no-subcommand-flag", "weights -i INV (no subcommand)", cmds=[["weights", "-i", REMOTE_INV]], file="-i")
case("keys-rotate-engine-flag", "keys rotate --engine --yes (no such flag)",
     cmds=[["keys", "rotate", "-i", RO_INV, "--engine", "--yes"]], file="--engine")
case("observe-up-scrape-units", "observe up --print --scrape-timeout 120s",
     cmds=[["observe", "up", "-i", RO_INV, "--print", "--scrape-timeout", "120s"]], file="--scrape-timeout")
# ==================================================================================================================
# G. sandbox flags
# ==================================================================================================================
case("sandbox-hosts-word", "sandbox up -n two", cmds=[[*SB, "-n", "two"]], file="--hosts")
case("sandbox-hardware-short", "sandbox up --hardware a2", cmds=[[*SB, "--hardware", "a2"]], file="--hardware",
     names=["a2"])
case("sandbox-name-underscore", "sandbox up --name my_sandbox", cmds=[[*SB, "--name", "my_sandbox"]], file="--name",
     names=["my_sandbox"])
case("sandbox-checkpoint-units", "sandbox up --checkpoint-mib 64M", cmds=[[*SB, "--checkpoint-mib", "64M"]],
     file="--checkpoint-mib")
case("sandbox-output-yaml", "sandbox status -o yaml", cmds=[["sandbox", "status", "-d", "{D}/sb", "-o", "yaml"]],
     file="yaml")
case("sandbox-fault-no-dir", "sandbox fault on a directory that holds no sandbox",
     files=[("empty", "dir", None, None)], cmds=[["sandbox", "fault", "-d", "{D}/empty", "host-down:sb-1"]], file="{D}/empty",
     expect="either", accept_rc=(1,), accept_names=["empty"],
     why="no sandbox up there: 'no sandbox is up in DIR' (1, a state, not bad input) or exit 2 naming the dir")
case("ok-sandbox-status-missing-dir", "sandbox status -d a directory that does not exist",
     cmds=[["sandbox", "status", "-d", "{D}/never"]], expect="either", file="{D}/never", accept_rc=(1,),
     accept_names=["never"],
     why="no sandbox: an empty status (0), 'no sandbox in DIR' (1, like any status of a thing not running) or a "
         "refusal naming the dir are all clear")

# ==================================================================================================================
# H. documented environment variables
# ==================================================================================================================
case("env-state-dir-under-file", "KIMICTL_STATE_DIR=a path below a regular file, plan", inv=BASE_INV, topo="a3-pd",
     files=[("f", "file", "x\n", 0o644)], env={"KIMICTL_STATE_DIR": "{D}/f/state"},
     cmds=[["plan", "-i", "{INV}", "-t", "a3-pd"]], file=["KIMICTL_STATE_DIR", "{D}/f/state"], expect="either", accept_rc=(1,),
     why="README: an unusable KIMICTL_STATE_DIR is exit 1 with its path (plan may not need it: 0; 2 naming it fine)")
case("ok-env-modelscope-token-static", "MODELSCOPE_API_TOKEN set with validate", inv=BASE_INV, topo="a3-pd",
     env={"MODELSCOPE_API_TOKEN": "ms-corpus6"}, cmds=STATIC, **OK, why="unused by static commands")
case("env-debug-bad-set", "KIMICTL_DEBUG=1 with rollout --set slo.quantile=1.5", env={"KIMICTL_DEBUG": "1"},
     cmds=rollout("slo.quantile=1.5"), file="--set", names=["quantile"])
case("ok-env-upstream-cache-missing-dir", "KIMICTL_UPSTREAM_CACHE=a missing dir, topology import of a local recipe",
     files=[("recipe.yaml", "file", recipe(), 0o644)], env={"KIMICTL_UPSTREAM_CACHE": "{D}/nocache"}, cmds=imp(), **OK,
     why="a local recipe needs no upstream cache")
case("env-admin-key-nul-like", "KIMICTL_PROXY_ADMIN_KEY='key with spaces and $' rollout --yes", cmds=[ROLL_YES],
     env={"KIMICTL_PROXY_ADMIN_KEY": "adm key $x"}, file="KIMICTL_PROXY_ADMIN_KEY")
case("env-engine-key-newline", "KIMICTL_ENGINE_API_KEY with a newline inside, deploy --yes",
     inv=rinv("    kimi_api_key_file: {D}/key\n"), files=KEY, cmds=[DEPLOY_YES],
     env={"KIMICTL_ENGINE_API_KEY": "ek\nsecond"}, file="KIMICTL_ENGINE_API_KEY")
case("env-hf-token-newline", "HF_TOKEN with a newline inside, weights pull on a huggingface inventory",
     inv=rinv("    kimi_model_source: huggingface\n"), env={"HF_TOKEN": "hf_a\nhf_b"},
     cmds=[["weights", "pull", "-i", "{INV}"]], file="HF_TOKEN")
case("ok-env-no-color-unset", "NO_COLOR unset, COLUMNS=40 (narrow terminal) with plan", inv=BASE_INV, topo="a3-pd",
     env={"COLUMNS": "40"}, cmds=[["plan", "-i", "{INV}", "-t", "a3-pd"]], **OK, why="narrow output is still output")

# machinery
# ==================================================================================================================

def _env(extra: dict | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KIMICTL_", "MODELSCOPE", "HF_", "XDG_", "ANSIBLE_", "PYTHONPATH"))}
    env.update({"KIMICTL_STATE_DIR": str(STATE), "HOME": str(HOME), "NO_COLOR": "1", "COLUMNS": "200",
                "TERM": "dumb", "ANSIBLE_HOME": str(HOME / ".ansible"),
                "ANSIBLE_LOCAL_TEMP": str(HOME / ".ansible" / "tmp")})
    env.update(extra or {})
    return env


def _sub(s: str, d: Path) -> str:
    return s.replace("{D}", str(d))


FIXTURE_CODE = """
import json, os, sys
from pathlib import Path
from kimictl.inventory import load_inventory
from kimictl.topology import load_topology
from kimictl.plan import make_plan
from kimictl.render import render
from kimictl.state import release_id
state, inv_path, cluster = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
inv = load_inventory(inv_path); topo = load_topology("a3-pd")
r = render(make_plan(inv, topo), inv, topo)
run = state / cluster / "runs" / "x"; run.mkdir(parents=True)
(run / "rendered.json").write_text(r.model_dump_json())
(state / cluster / "current.json").write_text(json.dumps({"release": release_id(r.releases), "hosts": r.releases,
                                                          "run_dir": str(run), "result": "deployed"}))
"""


def setup_fixtures() -> None:
    """Inventories for the remote commands, a fabricated recorded deploy (as tests/unit/test_rollout.py makes one)
    so that rollout/heal/stop get to their own checks, and a damaged record."""
    FIX.mkdir(parents=True, exist_ok=True)
    HOME.mkdir(parents=True, exist_ok=True)
    if RECIPE_SRC.exists():
        shutil.copyfile(RECIPE_SRC, RECIPE)
    base = ("all:\n  vars:\n    kimi_cluster: {c}\n    kimi_model_dir: /data/models/Kimi-K2.5-W4A8\n"
            "    kimi_model_endpoint: http://127.0.0.1:9\n    kimi_nic: eth0\n    ansible_port: 9\n"
            "    ansible_ssh_common_args: -o UserKnownHostsFile={kh}\n  hosts:\n"
            "    {p}-p: {{ansible_host: {a}, kimi_hardware: atlas-800-a3}}\n"
            "    {p}-d: {{ansible_host: {b}, kimi_hardware: atlas-800-a3}}\n")
    kh = HOME / "known_hosts"
    kh.touch()
    (HOME / "t.yml").write_text(BASE_TOPO)   # for cli-topology-tilde-quoted
    Path(REMOTE_INV).write_text(base.format(c="kimi-c5rm", kh=kh, p="rm", a="127.0.0.71", b="127.0.0.72"))
    Path(RO_INV).write_text(base.format(c="kimi-c5ro", kh=kh, p="ro", a="127.0.0.73", b="127.0.0.74") +
                            "    ro-p2: {ansible_host: 127.0.0.83, kimi_hardware: atlas-800-a3}\n"
                            "    ro-d2: {ansible_host: 127.0.0.84, kimi_hardware: atlas-800-a3}\n")
    Path(NODEPLOY_INV).write_text(base.format(c="kimi-c5nd", kh=kh, p="nd", a="127.0.0.75", b="127.0.0.76"))
    Path(DAMAGED_INV).write_text(base.format(c="kimi-c5dmg", kh=kh, p="dm", a="127.0.0.77", b="127.0.0.78"))
    if STATE.exists():
        shutil.rmtree(STATE)
    STATE.mkdir(parents=True)
    subprocess.run(["timeout", "120", VENV_PY, "-c", FIXTURE_CODE, str(STATE), RO_INV, "kimi-c5ro"], check=True,
                   env=_env({"PYTHONPATH": SRC} if SRC else None))
    cur = json.loads((STATE / "kimi-c5ro" / "current.json").read_text())
    (STATE / "kimi-c5ro" / "releases.jsonl").write_text(json.dumps(cur) + "\n")
    (STATE / "kimi-c5dmg").mkdir(parents=True)
    (STATE / "kimi-c5dmg" / "current.json").write_text('{"release": "abc", "hosts": {')


def materialize(c: dict) -> tuple[Path, str | None, str | None]:
    d = CASES_DIR / c["id"]
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    for rel, kind, content, mode in c.get("files", []):
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if kind == "dir":
            p.mkdir()
        elif kind == "fifo":
            os.mkfifo(p)
        elif kind == "socket":
            import socket
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(p))
            s.close()
        elif kind == "symlink":
            p.symlink_to(_sub(content, d))
        else:
            p.write_bytes(content if isinstance(content, bytes) else _sub(content, d).encode())
        if mode is not None and kind != "symlink":
            p.chmod(mode)
    inv_path = None
    if c.get("inv") is not None:
        p = d / "inv.yml"
        t = c["inv"]
        p.write_bytes(t if isinstance(t, bytes) else _sub(t, d).encode())
        p.chmod(c.get("mode", 0o644))
        inv_path = str(p)
    topo_arg = c.get("topo")
    if isinstance(topo_arg, bytes) or (isinstance(topo_arg, str) and "\n" in topo_arg):
        p = d / "topo.yml"
        p.write_bytes(topo_arg if isinstance(topo_arg, bytes) else _sub(topo_arg, d).encode())
        topo_arg = str(p)
    elif isinstance(topo_arg, str):
        topo_arg = _sub(topo_arg, d)
    return d, inv_path, topo_arg


def run_cmd(argv: list[str], cwd: Path, extra_env: dict | None = None) -> dict:
    t0 = time.monotonic()
    try:
        r = subprocess.run(["timeout", "-k", "5", str(TIMEOUT), KIMICTL, *argv], check=False, cwd=cwd, capture_output=True,
                           env=_env(extra_env), timeout=TIMEOUT + 30, stdin=subprocess.DEVNULL)
        rc, out, err = r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
        extract = None
        if argv and argv[0] == "render" and "json" in argv and rc == 0:
            try:   # keep what verify() needs before the output is cut
                doc = json.loads(out)
                extract = {"engines": [{k: e.get(k) for k in ("host", "role", "ip", "argv")} |
                                       {"env": {"GLOO_SOCKET_IFNAME": e.get("env", {}).get("GLOO_SOCKET_IFNAME")}}
                                       for e in doc.get("engines", [])]}
            except (json.JSONDecodeError, AttributeError):
                extract = None
        if len(out) > CAP:
            out = out[:CAP] + f"\n[... {len(out) - CAP} more characters cut by the harness]"
        if len(err) > CAP:
            err = err[:CAP] + f"\n[... {len(err) - CAP} more characters cut by the harness]"
    except subprocess.TimeoutExpired:
        rc, out, err, extract = 124, "", "(harness timeout)", None
    return {"argv": argv, "rc": rc, "stdout": out, "stderr": err, "seconds": round(time.monotonic() - t0, 2),
            "render": extract}


def _render_doc(runs: list[dict]) -> dict | None:
    for r in runs:
        if r["argv"][0] == "render" and "json" in r["argv"] and r["rc"] == 0:
            return r.get("render")
    return None


def verify(c: dict, runs: list[dict]) -> tuple[bool, str]:
    spec = c.get("verify")
    if not spec:
        return True, ""
    if spec[0] == "warning":
        text = "\n".join(r["stderr"] + r["stdout"] for r in runs)
        ok = "warning" in text and spec[1] in text
        return ok, f"a warning naming {spec[1]!r}: {'yes' if ok else 'no'}"
    if spec[0] == "exists":
        path = Path(_sub(spec[1], CASES_DIR / c["id"]))
        return path.exists(), f"{path} {'kept' if path.exists() else 'GONE'}"
    if spec[0] == "flowlists":   # every 'files: [...]' of merge.yml keeps exactly one entry
        path = Path(_sub(spec[1], CASES_DIR / c["id"]))
        if not path.is_file():
            return False, f"{path} missing"
        bad = [ln.strip() for ln in path.read_text().splitlines() if "files: [" in ln and "," in ln]
        return not bad, f"merge.yml flow lists with an injected entry: {bad[:1]}" if bad else "merge.yml intact"
    doc = _render_doc(runs)
    if doc is None:
        return False, "no render JSON to verify"
    if spec[0] == "roles":
        roles = {e["host"]: e["role"] for e in doc["engines"]}
        return roles == spec[1], f"rendered roles {roles}, expected {spec[1]}"
    if spec[0] == "ip":
        got = {e["host"]: e["ip"] for e in doc["engines"]}
        return got == spec[1], f"rendered engine IPs {got}, expected {spec[1]}"
    if spec[0] in ("argv_absent", "argv_has"):
        argvs = [e["argv"] for e in doc["engines"] if e["role"] == spec[1]]
        has = bool(argvs) and all(spec[2] in a for a in argvs)
        anyhas = any(spec[2] in a for a in argvs)
        ok = has if spec[0] == "argv_has" else (bool(argvs) and not anyhas)
        return ok, f"{spec[2]} in {spec[1]} argv: {'all' if has else ('some' if anyhas else 'none')}"
    if spec[0] == "nic":
        nics = {e["host"]: e["env"].get("GLOO_SOCKET_IFNAME") for e in doc["engines"]}
        return nics == spec[1], f"rendered NICs {nics}, expected {spec[1]}"
    return False, f"unknown verify {spec}"


def _topo_name(topo_arg: str | None) -> str:
    if not topo_arg:
        return "?"
    p = Path(topo_arg)
    if "/" not in topo_arg or not p.is_file():
        return topo_arg
    for line in p.read_text(errors="replace").splitlines():
        if line.startswith("name:"):
            return line.split(":", 1)[1].strip()
    return "?"


def judge(c: dict, d: Path, inv_path: str | None, topo_arg: str | None, runs: list[dict]) -> dict:
    expect = c["expect"]
    need = c.get("file")
    if need == "inv":
        need_files = [inv_path]
    elif need == "topo":
        need_files = [topo_arg]
    elif need == "files":   # a cross-file (plan) error: either path, or the topology by name
        need_files = [x for x in (inv_path, topo_arg) if x] + [f"topology {_topo_name(topo_arg)}"]
    elif isinstance(need, list):
        need_files = [_sub(x, d) for x in need]
    elif need:
        need_files = [_sub(need, d)]
    else:
        need_files = []
    names = [_sub(n, d) for n in c.get("names", [])]
    per = []
    for r in runs:
        text = r["stdout"] + "\n" + r["stderr"]
        tb = "Traceback" in text
        slow = r["seconds"] > LIMIT_S
        names_file = (not need_files) or any(f and (f in text or json.dumps(f)[1:-1] in text) for f in need_files)
        bare = text.replace(str(d), "<CASEDIR>")   # names must be in the message, not only in the case's path
        missing = [n for n in names if n not in bare and json.dumps(n)[1:-1] not in bare]
        rejected_ok = r["rc"] == 2 and not tb and not slow and names_file and not missing
        acc_rcs = (0, *tuple(c.get("accept_rc", ())))
        acc_missing = [n for n in c.get("accept_names", []) if n not in text]
        accepted_ok = r["rc"] in acc_rcs and not tb and not slow and not acc_missing
        per.append({"rc": r["rc"], "traceback": tb, "slow": slow, "names_file": names_file, "missing": missing,
                    "seconds": r["seconds"], "rejected_ok": rejected_ok, "accepted_ok": accepted_ok})
    all_rej = all(p["rejected_ok"] for p in per)
    all_acc = all(p["accepted_ok"] for p in per)
    vok, vmsg = True, ""
    if all_acc and c.get("verify"):
        vok, vmsg = verify(c, runs)
    if expect == "reject":
        handled = all_rej
    elif expect == "accept":
        handled = all_acc and vok
    else:
        handled = all_rej or (all_acc and vok)
    how = "refused" if all_rej else ("accepted" if all_acc else "neither")
    return {"handled": handled, "how": how, "per": per, "verify": vmsg, "verify_ok": vok, "expect": expect}


def run_case(c: dict, verbose: bool = False) -> dict:
    d, inv_path, topo_arg = materialize(c)
    runs = []
    for tmpl in c.get("cmds") or STATIC:
        argv = [_sub(a, d).replace("{INV}", inv_path or "").replace("{TOPO}", topo_arg or "") for a in tmpl]
        env = {k: _sub(v, d) for k, v in (c.get("env") or {}).items()}
        r = run_cmd(argv, d, env)
        if r["seconds"] > LIMIT_S:  # a shared machine (CI running): a slow run gets one more try; a hang hangs again
            again = run_cmd(argv, d, env)
            r = again if again["seconds"] < r["seconds"] else r
        runs.append(r)
    res = judge(c, d, inv_path, topo_arg, runs)
    res.update({"id": c["id"], "what": c["what"], "runs": runs, "should": c.get("should", ""),
                "why": c.get("why", ""), "note": c.get("note", "")})
    if verbose:
        for r, p in zip(runs, res["per"], strict=False):
            print(f"--- {c['id']}: kimictl {' '.join(map(repr, r['argv']))}\n  rc={r['rc']} {p}\n"
                  f"  stdout: {r['stdout'][:800]}\n  stderr: {r['stderr'][:1500]}")
        print(f"  => handled={res['handled']} ({res['how']}) {res['verify']}")
    return res


def _short(text: str, n: int = 200) -> str:
    return " ".join(text.split())[:n]


def _should(res: dict) -> str:
    if res["should"]:
        return res["should"]
    if res["expect"] == "accept":
        return "accept it: valid input (exit 0)"
    per = res["per"]
    if any(p["slow"] for p in per):
        return "exit 2 at once (within 10 s) naming the file/flag and key"
    if any(p["traceback"] for p in per):
        return "exit 2 naming the file and key, without a traceback"
    if any(p["rc"] == 0 for p in per):
        return "exit 2 naming the file/flag and the offending key (it was accepted)"
    if any(p["rc"] not in (0, 2) for p in per):
        return "exit 2 before any host is contacted, naming the flag/key"
    return "exit 2 whose message names the file/flag and the offending key (and host)"


def report(results: list[dict]) -> str:
    n = len(results)
    ok = sum(r["handled"] for r in results)
    exp = {k: sum(r["expect"] == k for r in results) for k in ("reject", "accept", "either")}
    lines = [f"kimictl held-out corpus 6: {n} cases, {ok} handled ({100.0 * ok / n:.1f}%), {n - ok} unhandled",
             f"  expect reject: {exp['reject']}, accept (valid): {exp['accept']}, either: {exp['either']}",
             "  handled by kind: " + ", ".join(
                 f"{k} {sum(r['handled'] for r in results if r['expect'] == k)}/{exp[k]}" for k in exp if exp[k]) +
             (f"; without the 'either' cases: {sum(r['handled'] for r in results if r['expect'] != 'either')}/"
              f"{n - exp['either']} ({100.0 * sum(r['handled'] for r in results if r['expect'] != 'either') / max(1, n - exp['either']):.1f}%)"),
             f"  runs: {sum(len(r['runs']) for r in results)}, tracebacks: "
             f"{sum(p['traceback'] for r in results for p in r['per'])}, runs over 10 s: "
             f"{sum(p['slow'] for r in results for p in r['per'])}", ""]
    lines.append("UNHANDLED (id | command | input | exit code(s) | first 200 chars of output | should):")
    for r in results:
        if r["handled"]:
            continue
        good = "accepted_ok" if r["expect"] == "accept" else "rejected_ok"
        bad = [(run, p) for run, p in zip(r["runs"], r["per"], strict=False) if not p[good]] or list(zip(r["runs"], r["per"], strict=False))
        run, p = bad[0]
        cmd = "kimictl " + " ".join(a if a and not set(a) & set(" \n;$()'\"!") else repr(a) for a in run["argv"])
        codes = ",".join(str(x["rc"]) for x in r["runs"])
        extra = []
        if p["slow"]:
            extra.append(f"{p['seconds']}s")
        if p["traceback"]:
            extra.append("TRACEBACK")
        if p["missing"] and r["expect"] != "accept":
            extra.append(f"not named: {p['missing']}")
        if not p["names_file"] and r["expect"] != "accept":
            extra.append("file/flag not named")
        if r["verify"] and not r["verify_ok"]:
            extra.append(r["verify"])
        out = _short(run["stderr"] + " " + run["stdout"]) or "(no output)"
        lines.append(f"- {r['id']} | {cmd} | {r['what']} | rc {codes}{' (' + '; '.join(extra) + ')' if extra else ''}"
                     f" | {out} | {_should(r)}")
    lines += ["", "NOTES on handled cases:"]
    for r in results:
        if r["handled"] and r["note"]:
            lines.append(f"- {r['id']}: {r['note']}")
    lines += ["", "HANDLED BY ACCEPTANCE (expect accept/either, accepted; why that is right):"]
    for r in results:
        if r["handled"] and r["how"] == "accepted":
            lines.append(f"- {r['id']}: {r['what']} -- {r['why']}{' [' + r['verify'] + ']' if r['verify'] else ''}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    assert len({c["id"] for c in C}) == len(C), "duplicate case ids"
    if argv[:1] == ["--list"]:
        for c in C:
            print(f"{c['id']:40s} {c['expect']:7s} {c['what']}")
        print(len(C), "cases")
        return 0
    ids = set(argv)
    unknown = ids - {c["id"] for c in C}
    if unknown:
        print(f"unknown case ids: {sorted(unknown)}", file=sys.stderr)
        return 2
    CASES_DIR.mkdir(parents=True, exist_ok=True)
    setup_fixtures()
    results = []
    for c in C:
        if ids and c["id"] not in ids:
            continue
        results.append(run_case(c, verbose=bool(ids)))
        if not ids:
            print(f"{'ok ' if results[-1]['handled'] else 'BAD'} {c['id']}", file=sys.stderr, flush=True)
    text = report(results)
    if not ids:
        (ROOT / "results.json").write_text(json.dumps(results, indent=1))
        (ROOT / "report.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
