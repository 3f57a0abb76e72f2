"""Bad-input corpus: every case goes through the real CLI and must exit 2 with a clear message, no traceback.

One table (CASES). Each case names an inventory and a topology: a file under tests/data/bad/, a preset name,
or python data written by inventory_factory.
`expect` substrings must all be in the message (field/key name, host name, ...). `at` gives file:line: the
message must contain `<file>:<n>` where n is the first non-comment line of that file starting with `at`
(after indentation). Cases marked `bug` are kimictl defects the lead will fix: strict xfail.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kimictl.cli.main import app
from kimictl.errors import EXIT_INVALID

REPO = Path(__file__).resolve().parents[2]
BAD = REPO / "tests" / "data" / "bad"


@dataclass(frozen=True)
class Case:
    id: str
    inventory: str | dict[str, Any]
    topology: str | dict[str, Any] | None
    expect: tuple[str, ...]
    at: str | None = None  # file:line expected; the line starts with this text
    at_file: str = "inventory"  # "inventory" or "topology": which file `at` is in
    code: int = EXIT_INVALID
    bug: str | None = None


def _inv(vars_: dict[str, Any], hosts: dict[str, Any]) -> dict[str, Any]:
    base = {"kimi_cluster": "kimi-test", "kimi_model_dir": "/data/models/Kimi-K2.5-W4A8", "kimi_nic": "eth0"}
    return {"all": {"vars": {**base, **vars_}, "hosts": hosts}}


A3 = "atlas-800-a3"
A3P = {"ansible_host": "10.0.0.1", "kimi_hardware": A3}
A3D = {"ansible_host": "10.0.0.2", "kimi_hardware": A3}


def _pd(**changes: Any) -> dict[str, Any]:
    """A valid a3-pd-like topology with `changes` merged in (one level deep per top-level key)."""
    doc: dict[str, Any] = {
        "name": "bad-typed", "description": "a field of the wrong type", "hardware": A3, "mode": "pd",
        "proxy": {"port": 8000}, "ports": {"http_base": 7100, "rpc": 12321},
        "roles": {"prefill": {"dp": 2, "tp": 8}, "decode": {"dp": 4, "tp": 4}},
        "speculative": {"model_id": "lightseekorg/kimi-k2.5-eagle3", "num_speculative_tokens": {"decode": 3}},
    }
    for k, v in changes.items():
        doc[k] = {**doc[k], **v} if isinstance(v, dict) and isinstance(doc.get(k), dict) else v
    return doc


CASES: list[Case] = [
    # --- inventory keys -----------------------------------------------------------------------------------
    Case("unknown-key-did-you-mean", "inv-unknown-key-typo.yml", "a3-pd",
         ("kimi_hardwre", "did you mean 'kimi_hardware'", "host a3-d"), at="kimi_hardwre:"),
    Case("group-key-did-you-mean", "inv-group-var-typo.yml", "a3-pd",
         ("kimi_rol", "did you mean 'kimi_role'", "group decode"), at="kimi_rol:"),
    Case("cluster-key-on-host", "inv-cluster-key-on-host.yml", "a3-pd",
         ("kimi_model_dir", "cluster-wide", "all.vars", "host a3-d"), at="kimi_model_dir: /other"),
    Case("cluster-key-in-group", "inv-cluster-key-in-group.yml", "a3-pd",
         ("kimi_runtime", "cluster-wide", "group decode"), at="kimi_runtime:"),
    Case("missing-cluster", "inv-missing-cluster.yml", "a3-pd", ("kimi_cluster", "required", "all.vars"), at="all:"),
    Case("missing-model-dir", "inv-missing-model-dir.yml", "a3-pd",
         ("kimi_model_dir", "required", "all.vars"), at="all:"),
    Case("missing-hardware", "inv-missing-hardware.yml", "a3-pd",
         ("kimi_hardware", "required", "host a3-d"), at="a3-d:"),
    Case("missing-nic", "inv-missing-nic.yml", "a3-pd", ("kimi_nic", "required", "host a3-d"), at="a3-d:"),
    Case("relative-model-dir", "inv-relative-model-dir.yml", "a3-pd",
         ("kimi_model_dir", "models/Kimi-K2.5-W4A8", "absolute path"), at="kimi_model_dir:"),
    Case("dotdot-model-dir", "inv-dotdot-model-dir.yml", "a3-pd", ("kimi_model_dir", "'..'"), at="kimi_model_dir:"),
    Case("dotdot-state-dir", "inv-dotdot-state-dir.yml", "a3-pd",
         ("kimi_state_dir", "'..'", "host a3-d"), at="kimi_state_dir:"),
    Case("relative-state-dir", _inv({}, {"a3-p": A3P, "a3-d": {"ansible_host": "10.0.0.2", "kimi_hardware": A3,
                                                                "kimi_state_dir": "var/lib/kimi"}}),
         "a3-pd", ("kimi_state_dir", "absolute path", "host a3-d"), at="kimi_state_dir:"),
    Case("cluster-uppercase", "inv-cluster-uppercase.yml", "a3-pd",
         ("kimi_cluster", "KimiTest", "cluster name"), at="kimi_cluster:"),
    Case("cluster-underscore", "inv-cluster-underscore.yml", "a3-pd",
         ("kimi_cluster", "kimi_test", "cluster name"), at="kimi_cluster:"),
    Case("cluster-leading-dash", "inv-cluster-leading-dash.yml", "a3-pd",
         ("kimi_cluster", "-kimi", "cluster name"), at="kimi_cluster:"),
    Case("hostname-subshell", "inv-hostname-subshell.yml", "a3-pd", ("host name", "$(reboot)", "not safe"),
         at="'$(reboot)':"),
    Case("hostname-space", "inv-hostname-space.yml", "a3-pd", ("host name", "bad host", "not safe"),
         at="'bad host':"),
    Case("hostname-semicolon", "inv-hostname-semicolon.yml", "a3-pd", ("host name", "a3-d;reboot", "not safe"),
         at="'a3-d;reboot':"),
    Case("dup-ansible-host", "inv-dup-ansible-host.yml", "a3-pd",
         ("ansible_host", "10.0.0.1", "host a3-d", "a3-p"), at="a3-d:"),
    Case("dup-device-ips", "inv-dup-device-ips.yml", "a3-pd", ("device IP 10.20.0.1", "host a3-d", "a3-p"),
         at="a3-d:"),
    Case("dup-device-ip-same-host", _inv({}, {"a3-p": {**A3P, "kimi_device_ips": ["10.20.0.1"] * 16},
                                              "a3-d": {"ansible_host": "10.0.0.2", "kimi_hardware": A3}}),
         "a3-pd", ("device IP 10.20.0.1", "host a3-p"), at="a3-p:"),
    Case("device-ips-count-a2", "inv-device-ips-count-a2.yml", "a2-pd",
         ("kimi_device_ips", "7 addresses", "host a2-3", "8 NPUs"), at="a2-3:"),
    Case("device-ips-count-a3", "inv-device-ips-count-a3.yml", "a3-pd",
         ("kimi_device_ips", "8 addresses", "host a3-d", "16 NPUs"), at="a3-d:"),
    Case("device-ip-invalid", "inv-device-ip-invalid.yml", "a3-pd",
         ("kimi_device_ips", "10.20.1.300", "host a3-d"), at="kimi_device_ips:"),
    Case("device-ips-string", "inv-device-ips-string.yml", "a3-pd",
         ("kimi_device_ips", "list", "host a3-d"), at="kimi_device_ips:"),
    Case("host-ip-invalid", "inv-host-ip-invalid.yml", "a3-pd", ("kimi_host_ip", "a3-d.internal", "host a3-d"),
         at="kimi_host_ip:"),
    Case("ansible-host-number", _inv({}, {"a3-p": A3P, "a3-d": {"ansible_host": 1234, "kimi_hardware": A3}}),
         "a3-pd", ("ansible_host", "host a3-d", "YAML read this as the number"), at="ansible_host: 1234"),
    Case("unknown-hardware-did-you-mean", "inv-unknown-hardware.yml", "a3-pd",
         ("kimi_hardware", "atlas-800a3", "did you mean 'atlas-800-a3'", "host a3-d"), at="kimi_hardware: atlas-800a3"),
    Case("role-yaml-boolean", "inv-role-bool.yml", "a3-pd",
         ("kimi_role", "host a3-d", "YAML read this as the boolean"), at="kimi_role:"),
    Case("runtime-yaml-boolean", "inv-runtime-bool.yml", "a3-pd",
         ("kimi_runtime", "YAML read this as the boolean"), at="kimi_runtime:"),
    Case("version-yaml-number", _inv({"kimi_vllm_ascend_version": 0.23}, {"a3-p": A3P}), "a3-pd",
         ("kimi_vllm_ascend_version", "YAML read this as the number"), at="kimi_vllm_ascend_version:"),
    Case("role-invalid", "inv-role-invalid.yml", "a3-pd", ("kimi_role", "host a3-d", "prefill", "decode"),
         at="kimi_role:"),
    Case("nic-shell", "inv-nic-shell.yml", "a3-pd", ("kimi_nic", "eth0;reboot", "host a3-d"),
         at='kimi_nic: "eth0;reboot"'),
    Case("engine-command-shell", "inv-engine-command-shell.yml", "a3-pd",
         ("kimi_engine_command", "host a3-d"), at="kimi_engine_command:"),
    Case("media-dir-root", "inv-media-root.yml", "a3-pd", ("kimi_media_dir", "'/'"), at="kimi_media_dir:"),
    Case("dns-without-host-ip", "inv-dns-no-host-ip.yml", "a3-pd",
         ("a3-d.cluster.example.com", "kimi_host_ip", "host a3-d"), at="a3-d:"),
    Case("proxy-host-unknown", "inv-proxy-host-unknown.yml", "a3-pd",
         ("kimi_proxy_host", "a3-x", "not an inventory host"), at="kimi_proxy_host:"),
    Case("monitor-host-unknown", _inv({"kimi_monitor_host": "a3-q"}, {"a3-p": A3P}), "a3-pd",
         ("kimi_monitor_host", "a3-q", "not an inventory host", "did you mean 'a3-p'"), at="kimi_monitor_host:"),
    Case("version-unknown", "inv-version-unknown.yml", "a3-pd", ("kimi_vllm_ascend_version", "0.99.0", "0.23.0")),
    Case("version-unknown-file-line", "inv-version-unknown.yml", "a3-pd", ("kimi_vllm_ascend_version",),
         at="kimi_vllm_ascend_version:"),
    Case("model-id-space", "inv-model-id-space.yml", "a3-pd", ("kimi_model_id", "Kimi K2.5", "model id"),
         at="kimi_model_id:"),
    Case("model-id-shell", "inv-model-id-shell.yml", "a3-pd", ("kimi_model_id", "$(id)", "model id"),
         at="kimi_model_id:"),
    Case("endpoint-not-http", "inv-endpoint-bad.yml", "a3-pd", ("kimi_model_endpoint", "ftp://", "URL"),
         at="kimi_model_endpoint:"),
    Case("endpoint-shell", "inv-endpoint-shell.yml", "a3-pd", ("kimi_model_endpoint", "$(id)", "URL"),
         at="kimi_model_endpoint:"),
    # --- inventory file shape -----------------------------------------------------------------------------
    Case("duplicate-yaml-key", "inv-dup-yaml-key.yml", "a3-pd", ("duplicate key", "kimi_hardware"),
         at="kimi_hardware: atlas-800-a2"),
    Case("yaml-syntax", "inv-bad-yaml-syntax.yml", "a3-pd", ("invalid YAML",), at="a3-d:"),
    Case("yaml-tab", "inv-bad-yaml-indent.yml", "a3-pd", ("invalid YAML",), at="\tkimi_model_dir"),
    Case("empty-file", "inv-empty.yml", "a3-pd", ("inv-empty.yml", "all:")),
    Case("comments-only", "inv-comments-only.yml", "a3-pd", ("inv-comments-only.yml", "all:")),
    Case("not-a-mapping", "inv-not-a-mapping.yml", "a3-pd", ("inv-not-a-mapping.yml", "mapping")),
    Case("no-hosts", "inv-no-hosts.yml", "a3-pd", ("no hosts",)),
    Case("group-section-typo", "inv-group-section-typo.yml", "a3-pd",
         ("unknown section 'host'", "did you mean 'hosts'", "decode"), at="host:"),
    Case("host-vars-not-mapping", "inv-host-vars-not-mapping.yml", "a3-pd",
         ("host a3-d", "must be a mapping"), at="a3-d:"),
    Case("inventory-missing", "does-not-exist.yml", "a3-pd", ("inventory not found", "does-not-exist.yml")),
    Case("usage-missing-topology", "good-a3-2.yml", None, ("--topology",)),
    # --- inventory x topology (plan) ----------------------------------------------------------------------
    Case("a2-hosts-with-a3-pd", "inv-a2-two-hosts.yml", "a3-pd",
         ("a3-pd", "atlas-800-a3", "host a2-1", "host a2-2", "kimi_hardware is atlas-800-a2")),
    Case("mixed-hardware", "inv-mixed-hardware.yml", "topo-no-hardware.yml",
         ("atlas-800-a2", "atlas-800-a3", "mix")),
    Case("a2-pd-on-two-a2-hosts", "inv-a2-two-hosts.yml", "a2-pd",
         ("a2-pd", "2 atlas-800-a2 host(s)", "at least 4 hosts", "GiB", "does not fit")),
    Case("pins-impossible", "inv-pins-impossible.yml", "a3-pd", ("pinned: 2 prefill, 0 decode", "kimi_role")),
    Case("role-on-colocated", "inv-role-on-colocated.yml", "a3-colocated",
         ("colocated", "host a3-solo", "kimi_role")),
    Case("topology-did-you-mean", "good-a3-2.yml", "a3pd", ("unknown topology 'a3pd'", "did you mean 'a3-pd'")),
    Case("topology-file-missing", "good-a3-2.yml", "topo-does-not-exist.yml",
         ("topology not found", "topo-does-not-exist.yml")),
    # --- topology files -----------------------------------------------------------------------------------
    Case("reserved-flag-port", "good-a3-2.yml", "topo-reserved-port.yml",
         ("roles.prefill.serve", "'port'", "computed by kimictl"), at="prefill:", at_file="topology"),
    Case("reserved-flag-tp", "good-a3-2.yml", "topo-reserved-tp.yml",
         ("roles.decode.serve", "'tensor-parallel-size'", "computed by kimictl"), at="decode:", at_file="topology"),
    Case("serve-flag-dashes", "good-a3-2.yml", "topo-reserved-dashes.yml",
         ("--max-num-seqs", "without leading dashes"), at="decode:", at_file="topology"),
    Case("unknown-switch", "good-a3-2.yml", "topo-unknown-switch.yml",
         ("roles.decode.switches", "mlpao", "did you mean 'mlapo'"), at="decode:", at_file="topology"),
    Case("unknown-topology-key", "good-a3-2.yml", "topo-unknown-top-key.yml", ("shrae",), at="shrae:",
         at_file="topology"),
    Case("tp-not-a-number", "good-a3-2.yml", "topo-tp-string.yml", ("roles.decode.tp", "integer"),
         at="decode:", at_file="topology"),
    Case("pd-missing-decode", "good-a3-2.yml", "topo-missing-decode.yml", ("prefill and decode",)),
    Case("pd-without-proxy", "good-a3-2.yml", "topo-pd-no-proxy.yml", ("proxy",)),
    Case("topology-not-mapping", "good-a3-2.yml", "topo-not-mapping.yml", ("topo-not-mapping.yml", "mapping")),
    Case("mlapo-on-prefill", "good-a3-2.yml", "topo-mlapo-prefill.yml", ("role prefill", "mlapo", "decode")),
    Case("prefill-tp-below-decode", "good-a3-2.yml", "topo-prefill-tp-lt-decode.yml",
         ("prefill TP 4", "decode TP 8")),
    Case("prefill-tp-not-divisible", "good-a3-2.yml", "topo-prefill-tp-not-divisible.yml",
         ("role prefill", "TP 6", "64 attention heads")),
    Case("removed-env", "inv-removed-env-version.yml", "topo-removed-env.yml",
         ("ASCEND_BUFFER_POOL", "0.23.0")),
    Case("removed-additional-config", "good-a3-2.yml", "topo-removed-additional-config.yml",
         ("torchair_graph_config", "role decode")),
    Case("hbm-infeasible", "good-a3-1.yml", "topo-hbm-infeasible.yml",
         ("role colocated", "does not fit", "GiB", "DP1 x TP2")),
    Case("dp-not-divisible-over-nodes", "good-a3-2.yml", "topo-dp-not-divisible.yml",
         ("role decode", "DP 3", "2 hosts")),
    Case("too-many-npus-per-host", "good-a3-2.yml", "topo-too-many-npus.yml",
         ("role decode", "32 NPUs", "16")),
    Case("proxy-port-on-engine-port", "good-a3-2.yml", "topo-proxy-on-http-port.yml",
         ("host a3-p", "proxy", "7100", "collides")),
    Case("proxy-port-in-kv-range", "good-a3-2.yml", "topo-proxy-in-kv-range.yml",
         ("host a3-p", "proxy", "kv_port", "collides")),
    Case("rpc-port-in-http-range", "good-a3-2.yml", "topo-rpc-in-http-range.yml",
         ("host a3-p", "12321", "data-parallel-rpc-port", "collides")),
    Case("share-zero", "good-a3-2.yml", "topo-share-zero.yml", ("share.prefill", "share.decode"), at="share:",
         at_file="topology"),
    Case("share-negative", "good-a3-2.yml", "topo-share-negative.yml", ("share.prefill",), at="share:",
         at_file="topology"),
    Case("kv-ports-beyond-65535", "good-a3-8.yml", "topo-kv-beyond-65535.yml", ("kv_port", "65535", "host a3-")),
    # --- found by this corpus and fixed ---------------------------------------------------------------------
    Case("duplicate-business-ip", "inv-dup-business-ip.yml", "a3-pd", ("10.0.0.1", "a3-d", "a3-p"), at="a3-d:"),
    Case("same-ip-other-ssh-port", "inv-same-ip-other-ssh-port.yml", "a3-pd", ("10.0.0.1", "a3-d", "a3-p"),
         at="a3-d:"),
    Case("gpu-memory-utilization-word", "good-a3-2.yml", "topo-gmu-word.yml",
         ("gpu-memory-utilization", "high"), at="prefill:", at_file="topology"),
    Case("gpu-memory-utilization-above-one", "good-a3-2.yml", "topo-gmu-over-one.yml",
         ("gpu-memory-utilization", "1.5"), at="prefill:", at_file="topology"),
    Case("max-model-len-word", "good-a3-2.yml", "topo-max-model-len-word.yml", ("max-model-len", "32k"),
         at="max-model-len:", at_file="topology"),
    Case("negative-batched-tokens", "good-a3-2.yml", "topo-negative-batched-tokens.yml",
         ("max-num-batched-tokens", "-5"), at="prefill:", at_file="topology"),
    Case("hccl-buffsize-word", "good-a3-2.yml", "topo-hccl-buffsize-word.yml", ("HCCL_BUFFSIZE", "big"),
         at="prefill:", at_file="topology"),
    Case("additional-config-string", "good-a3-2.yml", "topo-additional-config-string.yml",
         ("additional-config", "mapping"), at="decode:", at_file="topology"),
    Case("tp-not-dividing-attention-heads", "good-a3-2.yml", "topo-tp-not-dividing-heads.yml",
         ("TP 6", "64", "attention heads")),
    # --- issue 16 item 6: `$` accepts a trailing newline; every pattern is a fullmatch ------------------------
    Case("cluster-trailing-newline", "inv-cluster-trailing-newline.yml", "a3-pd",
         ("kimi_cluster", "'kimi-test\\n'", "cluster name"), at="kimi_cluster:"),
    Case("nic-trailing-newline", "inv-nic-trailing-newline.yml", "a3-pd", ("kimi_nic", "'eth1\\n'", "host a3-d"),
         at="a3-d:"),
    Case("hostname-trailing-newline", _inv({}, {"a3-p": A3P, "a3-d\n": A3D}), "a3-pd",
         ("host name", "'a3-d\\n'", "not safe")),
    Case("model-dir-trailing-newline", _inv({"kimi_model_dir": "/data/models/k\n"}, {"a3-p": A3P, "a3-d": A3D}),
         "a3-pd", ("kimi_model_dir", "'/data/models/k\\n'"), at="kimi_model_dir:"),
    Case("model-id-trailing-newline", _inv({"kimi_model_id": "Eco-Tech/Kimi-K2.5-W4A8\n"}, {"a3-p": A3P}),
         "a3-pd", ("kimi_model_id", "model id"), at="kimi_model_id:"),
    Case("revision-trailing-newline", _inv({"kimi_model_revision": "master\n"}, {"a3-p": A3P}), "a3-pd",
         ("kimi_model_revision", "revision"), at="kimi_model_revision:"),
    Case("endpoint-trailing-newline", _inv({"kimi_model_endpoint": "http://mirror.example.com\n"}, {"a3-p": A3P}),
         "a3-pd", ("kimi_model_endpoint", "URL"), at="kimi_model_endpoint:"),
    Case("engine-command-trailing-newline",
         _inv({}, {"a3-p": A3P, "a3-d": {**A3D, "kimi_engine_command": "/opt/sim/vllm\n"}}), "a3-pd",
         ("kimi_engine_command", "host a3-d"), at="kimi_engine_command:"),
    Case("dns-name-trailing-newline",
         _inv({}, {"a3-p": A3P, "a3-d": {"ansible_host": "a3-d.example.com\n", "kimi_host_ip": "10.0.0.2",
                                         "kimi_hardware": A3}}), "a3-pd",
         ("ansible_host", "neither an IP address nor a DNS name", "host a3-d"), at="ansible_host: 'a3-d"),
    Case("env-name-trailing-newline", "good-a3-2.yml", "topo-env-name-newline.yml",
         ("roles.decode.env", "'HCCL_OP_EXPANSION_MODE\\n'"), at="decode:", at_file="topology"),
    Case("serve-flag-trailing-newline", "good-a3-2.yml", "topo-serve-flag-newline.yml",
         ("roles.decode.serve", "'max-num-seqs\\n'"), at="decode:", at_file="topology"),
    # --- system directories (kimictl/data/system_dirs.yml) -----------------------------------------------------
    Case("model-dir-system", "inv-model-dir-system.yml", "a3-pd", ("kimi_model_dir", "'/usr' is a system directory"),
         at="kimi_model_dir:"),
    Case("state-dir-in-etc", "inv-state-dir-in-etc.yml", "a3-pd",
         ("kimi_state_dir", "'/etc/kimi' is inside the system directory '/etc'", "host a3-d"), at="kimi_state_dir:"),
    Case("state-dir-var", _inv({"kimi_state_dir": "/var"}, {"a3-p": A3P}), "a3-pd",
         ("kimi_state_dir", "'/var' is a system directory", "host a3-p"), at="kimi_state_dir:"),
    Case("media-dir-home", _inv({"kimi_media_dir": "/home/"}, {"a3-p": A3P}), "a3-pd",
         ("kimi_media_dir", "'/home' is a system directory"), at="kimi_media_dir:"),
    Case("draft-model-dir-proc", _inv({"kimi_draft_model_dir": "/proc/self"}, {"a3-p": A3P}), "a3-pd",
         ("kimi_draft_model_dir", "'/proc/self' is inside the system directory '/proc'"), at="kimi_draft_model_dir:"),
    # --- IPv6: refused with a message naming the host and key (URLs, HCCL and peer transfers are IPv4) ----------
    Case("ipv6-ansible-host", "inv-ipv6-ansible-host.yml", "a3-pd",
         ("host a3-d", "ansible_host", "'fd00::2' is an IPv6 address", "IPv4 only"), at="a3-d:"),
    # --- directories others may read hold no secrets (issue 27) -------------------------------------------------
    Case("model-dir-holds-state-dir", _inv({"kimi_model_dir": "/data/kimi"},
                                           {"a3-p": {**A3P, "kimi_state_dir": "/data/kimi/state"}, "a3-d": A3D}),
         "a3-pd", ("host a3-p", "kimi_model_dir /data/kimi holds kimi_state_dir /data/kimi/state", "secrets")),
    Case("media-dir-is-state-dir", _inv({"kimi_media_dir": "/var/lib/kimi"}, {"a3-p": A3P, "a3-d": A3D}),
         "a3-pd", ("host a3-p", "kimi_media_dir /var/lib/kimi holds kimi_state_dir /var/lib/kimi")),
    Case("media-dir-holds-model-dir", _inv({"kimi_media_dir": "/data"}, {"a3-p": A3P, "a3-d": A3D}),
         "a3-pd", ("kimi_media_dir /data holds kimi_model_dir /data/models/Kimi-K2.5-W4A8", "checkpoint")),
    Case("serve-api-key", "good-a3-2.yml", _pd(serve={"enable-expert-parallel": True, "api-key": "sk-123"}),
         ("serve flag 'api-key'", "never on the command line")),
    Case("topology-source-key", "good-a3-2.yml", {**_pd(), "source": 42}, ("source: not a topology key",)),
    # --- a held-out corpus (issue 27) found these -------------------------------------------------------------------
    Case("var-name-lookalike", _inv({}, {"a3-p": A3P, "a3-d": {**A3D, "k\u0456mi_role": "prefill"}}), "a3-pd",
         ("host a3-d", "is not a variable name", "did you mean 'kimi_role'")),
    Case("hosts-under-vars", _inv({"hosts": {"a3-x": {"ansible_host": "10.0.0.3"}}}, {"a3-p": A3P, "a3-d": A3D}),
         "a3-pd", ("all.vars", "'hosts' is a section of the group"), at="hosts:"),
    Case("all-as-child", {"all": {"vars": {"kimi_cluster": "kimi-test", "kimi_model_dir": "/data/models/m",
                                           "kimi_nic": "eth0"},
                                  "children": {"racks": {"hosts": {"a3-p": A3P, "a3-d": A3D},
                                                         "children": {"all": None}}}}},
         "a3-pd", ("group 'racks'", "'all' cannot be a child")),
    Case("host-named-null", "inv-host-named-null.yml", "a3-pd", ("host name 'None' is not text", "null"), at="~:"),
    Case("duplicate-anchor", "inv-duplicate-anchor.yml", "a3-pd", ("duplicate anchor 'x'",)),
    Case("nul-escape", "inv-nul-escape.yml", "a3-pd", ("all.hosts.a3-p.kimi_engine_command", "NUL"), at="a3-p:"),
    Case("ansible-host-octet-256", _inv({}, {"a3-p": A3P, "a3-d": {**A3D, "ansible_host": "10.0.0.256",
                                                                   "kimi_host_ip": "10.0.0.2"}}),
         "a3-pd", ("host a3-d", "ansible_host", "'10.0.0.256' is not a valid IPv4 address")),
    Case("ansible-host-octal", _inv({}, {"a3-p": A3P, "a3-d": {**A3D, "ansible_host": "10.0.0.010",
                                                               "kimi_host_ip": "10.0.0.2"}}),
         "a3-pd", ("host a3-d", "'10.0.0.010' is not a valid IPv4 address", "leading zeros")),
    Case("device-ip-is-a-business-address",
         _inv({}, {"a3-p": A3P, "a3-d": {**A3D, "kimi_device_ips": ["10.0.0.1", *(f"10.9.0.{i}" for i in range(15))]}}),
         "a3-pd", ("host a3-d", "device IP 10.0.0.1 is host a3-p's business address")),
    Case("draft-dir-is-model-dir", _inv({"kimi_draft_model_dir": "/data/models/Kimi-K2.5-W4A8"},
                                        {"a3-p": A3P, "a3-d": A3D}),
         "a3-pd", ("kimi_draft_model_dir /data/models/Kimi-K2.5-W4A8 and kimi_model_dir", "overlap"),
         at="kimi_draft_model_dir:"),
    Case("endpoint-port-out-of-range", _inv({"kimi_model_endpoint": "http://mirror.example.com:99999"},
                                            {"a3-p": A3P, "a3-d": A3D}),
         "a3-pd", ("kimi_model_endpoint", "port 99999 is not a TCP port")),
    Case("image-repo-port-out-of-range", _inv({"kimi_image_repo": "registry.example.internal:99999/ascend/vllm"},
                                              {"a3-p": A3P, "a3-d": A3D}),
         "a3-pd", ("kimi_image_repo", "port 99999 is not a TCP port")),
    Case("revision-dotdot", _inv({"kimi_model_revision": "v1/../../etc"}, {"a3-p": A3P, "a3-d": A3D}), "a3-pd",
         ("kimi_model_revision", "'..'")),
    Case("version-bare-major", _inv({"kimi_vllm_ascend_version": "0"}, {"a3-p": A3P, "a3-d": A3D}), "a3-pd",
         ("kimi_vllm_ascend_version", "unsupported vllm-ascend version '0'")),
    Case("engine-command-config-flag", _inv({}, {"a3-p": A3P, "a3-d": {**A3D, "kimi_engine_command":
                                                                           "vllm --config /etc/x.yaml"}}),
         "a3-pd", ("host a3-d", "kimi_engine_command passes --config", "reads more flags from a file")),
    # --- addresses that name no single host, SSH options nobody can read (issue 27) ------------------------------
    Case("ansible-host-unspecified", _inv({}, {"a3-p": A3P, "a3-d": {**A3D, "ansible_host": "0.0.0.0"}}), "a3-pd",
         ("host a3-d", "ansible_host", "'0.0.0.0' is the unspecified address"), at="ansible_host: 0.0.0.0"),
    Case("host-ip-multicast", _inv({}, {"a3-p": A3P, "a3-d": {**A3D, "kimi_host_ip": "224.0.0.1"}}), "a3-pd",
         ("host a3-d", "kimi_host_ip", "multicast"), at="kimi_host_ip:"),
    Case("ssh-args-unbalanced-quote",
         _inv({}, {"a3-p": A3P, "a3-d": {**A3D, "ansible_ssh_common_args": "-o 'UserKnownHostsFile=/x"}}), "a3-pd",
         ("host a3-d", "ansible_ssh_common_args", "No closing quotation")),
    Case("ipv6-host-ip", _inv({}, {"a3-p": A3P, "a3-d": {**A3D, "kimi_host_ip": "fd00::2"}}), "a3-pd",
         ("host a3-d", "kimi_host_ip", "IPv6", "IPv4 only"), at="kimi_host_ip:"),
    Case("ipv6-device-ip", _inv({}, {"a3-p": {**A3P, "kimi_device_ips": [f"fd00::{i + 1}" for i in range(16)]}}),
         "a3-pd", ("host a3-p", "kimi_device_ips.0", "IPv6"), at="kimi_device_ips:"),
    # --- group precedence inputs Ansible refuses too ---------------------------------------------------------
    Case("group-priority-word", "inv-group-priority-word.yml", "a3-pd",
         ("group decode", "ansible_group_priority", "'high'"), at="ansible_group_priority:"),
    Case("group-cycle", "inv-group-cycle.yml", "a3-pd", ("'racks' is its own ancestor", "decode"), at="racks:"),
    Case("ansible-port-word", "inv-ansible-port-word.yml", "a3-pd", ("host a3-d", "ansible_port", "'ssh'"),
         at="a3-d:"),
    # --- topology numbers are strictly typed ----------------------------------------------------------------------
    Case("dp-quoted", "good-a3-2.yml", "topo-dp-quoted.yml", ("roles.decode.dp", "integer", "'4'", "without quotes"),
         at="decode:", at_file="topology"),
    Case("tp-float", "good-a3-2.yml", "topo-tp-float.yml", ("roles.decode.tp", "integer", "4.0"), at="tp: 4.0",
         at_file="topology"),
    Case("nodes-boolean", "good-a3-2.yml", "topo-nodes-bool.yml", ("roles.decode.nodes", "integer", "boolean"),
         at="nodes: true", at_file="topology"),
    Case("http-base-quoted", "good-a3-2.yml", "topo-port-quoted.yml", ("ports.http_base", "integer", "'7100'"),
         at="http_base:", at_file="topology"),
    Case("proxy-port-float", "good-a3-2.yml", "topo-proxy-port-float.yml", ("proxy.port", "integer", "8000.0"),
         at="port: 8000.0", at_file="topology"),
    Case("share-quoted", "good-a3-2.yml", "topo-share-quoted.yml", ("share.decode", "integer", "'2'"),
         at="decode:", at_file="topology"),
    Case("routers-boolean", "good-a3-2.yml", _pd(proxy={"routers": True}), ("proxy.routers", "integer", "boolean")),
    Case("rpc-port-quoted", "good-a3-2.yml", _pd(ports={"rpc": "12321"}), ("ports.rpc", "integer", "'12321'")),
    Case("spec-tokens-quoted", "good-a3-2.yml",
         _pd(speculative={"model_id": "lightseekorg/kimi-k2.5-eagle3", "num_speculative_tokens": {"decode": "3"}}),
         ("speculative.num_speculative_tokens.decode", "integer", "'3'")),
    Case("spec-model-id-shell", "good-a3-2.yml",
         _pd(speculative={"model_id": "x; rm -rf /", "num_speculative_tokens": {"decode": 3}}),
         ("speculative.model_id", "'x; rm -rf /'", "owner/name")),
    # --- reserved serve flags cannot be sneaked in ------------------------------------------------------------------
    Case("reserved-flag-abbreviated", "good-a3-2.yml", "topo-reserved-abbrev.yml",
         ("roles.decode.serve", "'tensor-parallel'", "abbreviates 'tensor-parallel-size'"), at="decode:",
         at_file="topology"),
    Case("reserved-flag-abbreviated-name", "good-a3-2.yml", "topo-reserved-abbrev-name.yml",
         ("roles.prefill.serve", "'served-model'", "abbreviates 'served-model-name'"), at="serve: {served-model",
         at_file="topology"),
    Case("reserved-flag-config-file", "good-a3-2.yml", "topo-reserved-config.yml",
         ("roles.decode.serve", "'config'", "reads more flags from a file"), at="decode:", at_file="topology"),
    Case("serve-value-looks-like-a-flag", "good-a3-2.yml", "topo-serve-dash-value.yml",
         ("roles.decode.serve", "'disable-log-stats'", "'--port=9'", "another flag"), at="decode:",
         at_file="topology"),
    # --- the P/D router (issue 13) and the engines' key (issue 16 item 2) -----------------------------------------
    Case("router-kind-unknown", "good-a3-2.yml", _pd(proxy={"router": "nginx"}),
         ("proxy.router", "vllm-ascend-proxy", "vllm-router")),
    Case("policy-with-the-upstream-proxy", "good-a3-2.yml",
         _pd(proxy={"policy": "random"}, serve={"enable-expert-parallel": True}),
         ("proxy.policy random", "vllm-router")),
    Case("vllm-router-with-recompute", "good-a3-2.yml",
         _pd(proxy={"router": "vllm-router"}, serve={"enable-expert-parallel": True},
             roles={"prefill": {"dp": 2, "tp": 8}, "decode": {"dp": 4, "tp": 4,
                                                          "switches": {"recompute_scheduler": True}}}),
         ("recompute_scheduler", "vllm-router", "proxy.router: vllm-ascend-proxy", "recompute_scheduler: false")),
    Case("host-runtime-without-proxy-script",
         _inv({"kimi_runtime": "host"}, {"a3-p": A3P, "a3-d": A3D}), "a3-pd",
         ("kimi_proxy_script", "a3-p", "load_balance_proxy_server_example.py")),
    Case("engine-bind-unknown", "good-a3-2.yml", _pd(engine_bind="localhost"), ("engine_bind", "host-ip", "all")),
    # --- YAML that explodes or never ends --------------------------------------------------------------------------
    Case("alias-bomb-topology", "good-a3-2.yml", "topo-alias-bomb.yml",
         ("topo-alias-bomb.yml", "serve.additional-config.l5", "more than 100000 values", "aliases"), at="l5:",
         at_file="topology"),
    Case("alias-bomb-inventory", "inv-alias-bomb.yml", "a3-pd",
         ("inv-alias-bomb.yml", "all.vars.l5", "more than 100000 values"), at="l5:"),
    # --- files that are not YAML text (issue 27): refused without reading them forever or a traceback --------------
    Case("inventory-dev-zero", "/dev/zero", "a3-pd", ("inventory /dev/zero", "not a regular file")),
    Case("inventory-dev-urandom", "/dev/urandom", "a3-pd", ("inventory /dev/urandom", "not a regular file")),
    Case("topology-dev-zero", "good-a3-2.yml", "/dev/zero", ("topology /dev/zero", "not a regular file")),
    Case("inventory-nul-byte", "inv-nul-byte.yml", "a3-pd", ("inv-nul-byte.yml", "U+0000", "not allowed"),
         at="kimi_cluster:"),
    Case("inventory-is-a-directory", "/", "a3-pd", ("cannot read inventory /", "directory")),
    Case("alias-loop-inventory", "inv-alias-loop.yml", "a3-pd", ("used inside itself",), at="all: &all"),
    Case("nested-too-deep", "inv-nested-too-deep.yml", "a3-pd", ("inv-nested-too-deep.yml", "nested too deeply")),
]

COMMANDS = ("validate", "plan", "render")
JSON_CASES = ("unknown-key-did-you-mean", "yaml-syntax", "a2-pd-on-two-a2-hosts", "reserved-flag-port",
              "topology-did-you-mean", "proxy-port-in-kv-range", "removed-env", "share-zero", "dp-quoted",
              "ipv6-ansible-host", "alias-bomb-topology", "reserved-flag-abbreviated")


def _path(name: str) -> Path:
    return BAD / name


@pytest.fixture
def resolve(inventory_factory):
    """(inventory path, topology argument or None, path of the file `at` refers to) for a case."""

    def run(case: Case) -> tuple[Path, str | None, Path | None]:
        inv = inventory_factory(case.inventory) if isinstance(case.inventory, dict) else _path(case.inventory)
        topo = case.topology
        if isinstance(topo, dict):
            topo = str(inventory_factory(topo, name="topology.yml"))
        elif topo is not None and topo.endswith(".yml"):
            topo = str(_path(topo))
        located = inv if case.at_file == "inventory" else (Path(topo) if topo else None)
        return inv, topo, located

    return run


def _line_of(path: Path, start: str) -> int:
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip(" ").startswith("#"):
            continue
        if line.lstrip(" ").startswith(start):
            return n
    raise AssertionError(f"{path} has no line starting with {start!r}")


def _params(cases, extra=None):
    out = []
    for c in cases:
        marks = [pytest.mark.xfail(strict=True, reason=f"BUG: {c.bug}")] if c.bug else []
        for e in extra or [None]:
            out.append(pytest.param(c, e, id=c.id if e is None else f"{c.id}-{e}", marks=marks))
    return out


def _invoke(args: list[str]):
    result = CliRunner().invoke(app, args)
    # CliRunner swallows uncaught exceptions (it prints nothing): an exception other than the exit is a crash.
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    for stream in (result.stdout, result.stderr):
        assert "Traceback" not in stream
    return result


def test_corpus_is_big_enough_and_ids_unique():
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)
    referenced = {x for c in CASES for x in (c.inventory, c.topology) if isinstance(x, str)}
    unused = sorted(p.name for p in BAD.glob("*.yml") if p.name not in referenced)
    assert not unused, f"corpus files without a table entry: {unused}"


@pytest.mark.parametrize(("case", "command"), _params(CASES, COMMANDS))
def test_bad_input_exits_2_with_clear_message(case: Case, command: str, resolve) -> None:
    inv, topo, located = resolve(case)
    args = [command, "-i", str(inv)] + (["--topology", topo] if topo is not None else [])
    result = _invoke(args)
    assert result.exit_code == case.code, result.output
    message = result.stderr
    assert message.strip(), "no message on stderr"
    for want in case.expect:
        assert want in message, f"{want!r} not in:\n{message}"
    if case.at is not None:
        assert located is not None
        where = f"{located}:{_line_of(located, case.at)}"
        assert where in message, f"{where!r} not in:\n{message}"
    if case.topology is not None:  # click usage errors print the usage text; ours print nothing on stdout
        assert result.stdout == "", "an error must not leave partial output on stdout"


@pytest.mark.parametrize(("case", "command"), _params([c for c in CASES if c.id in JSON_CASES], COMMANDS))
def test_bad_input_json_output_is_one_error_document(case: Case, command: str, resolve) -> None:
    inv, topo, located = resolve(case)
    result = _invoke([command, "-i", str(inv), "--topology", str(topo), "--output", "json"])
    assert result.exit_code == case.code
    doc = json.loads(result.stdout)  # exactly one JSON document, nothing else on stdout
    assert set(doc) == {"error"}
    err = doc["error"]
    assert err["code"] == case.code
    assert err["type"] in ("InvalidInput", "InventoryError", "TopologyError", "PlanError")
    text = "\n".join([err["message"], *err["details"], err["hint"] or ""])
    for want in case.expect:
        assert want in text, f"{want!r} not in:\n{text}"
    if case.at is not None:
        assert f"{located}:{_line_of(located, case.at)}" in text


def test_json_ids_exist():
    assert set(JSON_CASES) <= {c.id for c in CASES}


# --- issue 16 item 6: kimi_api_key_file is checked by validate and plan, not only by deploy ----------------------


def _key_file(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A kimi_api_key_file that is wrong in one way, and the words the error must say."""
    import os

    path = tmp_path / "proxy-api-key"
    if kind == "missing":
        return path, "No such file or directory"
    if kind == "directory":
        path.mkdir()
        return path, "not a regular file"
    if kind == "fifo":  # reading it would block for ever
        os.mkfifo(path, 0o600)
        return path, "not a regular file"
    path.write_text("" if kind == "empty" else "sk-test-key-1234\n")
    path.chmod(0o644 if kind == "world-readable" else 0o600)
    return path, {"empty": "is empty", "world-readable": "readable by others (mode 644)"}[kind]


@pytest.mark.parametrize("command", ["validate", "plan"])
@pytest.mark.parametrize("kind", ["missing", "directory", "fifo", "empty", "world-readable"])
def test_api_key_file_is_checked_by_static_commands(tmp_path: Path, inventory_factory, kind: str,
                                                    command: str) -> None:
    key, why = _key_file(tmp_path, kind)
    inv = inventory_factory(_inv({"kimi_api_key_file": str(key)}, {"a3-p": A3P, "a3-d": A3D}))
    result = _invoke([command, "-i", str(inv), "--topology", "a3-pd"])
    assert result.exit_code == EXIT_INVALID, result.output
    assert f"{inv}:{_line_of(inv, 'kimi_api_key_file:')}: all.vars: kimi_api_key_file {key}" in result.stderr
    assert why in result.stderr
    assert result.stdout == ""


# --- issue 16 item 7: no traceback for user error -----------------------------------------------------------------


@pytest.mark.parametrize("where", ["file", "below-a-file"])
def test_render_out_onto_a_file_exits_2_and_writes_nothing(tmp_path: Path, where: str) -> None:
    target = tmp_path / "render-out"
    target.write_text("not a directory\n")
    out = target if where == "file" else target / "sub"
    result = _invoke(["render", "-i", str(BAD / "good-a3-2.yml"), "--topology", "a3-pd", "--out", str(out)])
    assert result.exit_code == EXIT_INVALID, result.output
    assert f"--out {out}: {target} exists and is not a directory" in result.stderr
    assert target.read_text() == "not a directory\n" and result.stdout == ""


def test_logs_bundle_onto_a_directory_exits_2_before_collecting(tmp_path: Path, inventory_factory) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": {**A3P, "ansible_host": "127.0.0.1", "ansible_port": 9}}))
    result = _invoke(["logs", "-i", str(inv), "--bundle", str(tmp_path)])
    assert result.exit_code == EXIT_INVALID, result.output
    assert f"{tmp_path} is a directory" in result.stderr and "collecting" not in result.stderr


@pytest.mark.parametrize("variable", ["KIMICTL_STATE_DIR", "XDG_STATE_HOME"])
def test_unwritable_state_dir_is_one_message_naming_it(tmp_path: Path, inventory_factory, monkeypatch,
                                                       variable: str) -> None:
    """preflight records its report in the state dir; here that is below a regular file."""
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    monkeypatch.delenv("KIMICTL_STATE_DIR", raising=False)
    monkeypatch.setenv(variable, str(blocker / "state"))
    inv = inventory_factory(_inv({"kimi_model_source": "local"},
                                 {"a3-p": {**A3P, "ansible_host": "127.0.0.1", "ansible_port": 9}}))
    result = _invoke(["preflight", "-i", str(inv), "--topology", "a3-colocated"])
    assert result.exit_code == 1, result.output
    base = blocker / "state" if variable == "KIMICTL_STATE_DIR" else blocker / "state" / "kimictl"
    assert f"error: cannot use the control-node state directory {base}: Not a directory" in result.stderr
    assert "KIMICTL_STATE_DIR" in result.stderr


def test_unexpected_missing_file_is_an_operation_failure_not_invalid_input(monkeypatch, tmp_path: Path) -> None:
    """A FileNotFoundError from deep inside an operation is exit 1 with its path (exit 2 promises bad input and
    nothing changed); KIMICTL_DEBUG=1 lets its traceback through."""
    import kimictl.render

    def vanished(*_a, **_k):
        raise FileNotFoundError(2, "No such file or directory", "/opt/kimictl/templates/engine.sh.j2")

    monkeypatch.setattr(kimictl.render, "write_rendered", vanished)
    args = ["render", "-i", str(BAD / "good-a3-2.yml"), "--topology", "a3-pd", "--out", str(tmp_path / "o")]
    result = _invoke(args)
    assert result.exit_code == 1, result.output
    assert "error: the operation failed: No such file or directory: /opt/kimictl/templates/engine.sh.j2" \
        in result.stderr
    assert "KIMICTL_DEBUG=1" in result.stderr
    monkeypatch.setenv("KIMICTL_DEBUG", "1")
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, FileNotFoundError)


@pytest.fixture(scope="module")
def unreachable_hosts(tmp_path_factory):
    """An inventory of hosts that fail to connect in different ways: a closed port, a server that answers with
    garbage instead of an SSH banner, one that resets the connection, and a real SSH server (paramiko) with a
    missing key file."""
    import socket
    import struct
    import threading

    import paramiko

    stop = threading.Event()
    listeners = []

    def serve(address: str, handle) -> int:
        s = socket.socket()
        s.bind((address, 0))
        s.listen(16)
        s.settimeout(0.2)
        listeners.append(s)

        def loop() -> None:
            while not stop.is_set():
                try:
                    conn, _ = s.accept()
                except OSError:
                    continue
                try:
                    handle(conn)
                except (OSError, EOFError, paramiko.SSHException):  # the client gave up: its side is under test
                    conn.close()

        threading.Thread(target=loop, daemon=True).start()
        return s.getsockname()[1]

    def garbage(conn) -> None:
        conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
        conn.close()

    def reset(conn) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    host_key = paramiko.RSAKey.generate(2048)
    transports = []

    def ssh(conn) -> None:
        t = paramiko.Transport(conn)
        t.add_server_key(host_key)
        t.start_server(server=paramiko.ServerInterface())
        transports.append(t)

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    d = tmp_path_factory.mktemp("unreachable")
    hosts = {
        "h-closed": {"ansible_host": "127.0.0.1", "ansible_port": closed_port},
        "h-garbage": {"ansible_host": "127.0.0.2", "ansible_port": serve("127.0.0.2", garbage)},
        "h-reset": {"ansible_host": "127.0.0.3", "ansible_port": serve("127.0.0.3", reset)},
        "h-keyfile": {"ansible_host": "127.0.0.4", "ansible_port": serve("127.0.0.4", ssh),
                      "ansible_ssh_private_key_file": str(d / "missing_key"),
                      "ansible_ssh_common_args": f"-o StrictHostKeyChecking=no -o UserKnownHostsFile={d}/kh"},
    }
    inv = d / "inventory.yml"
    from tests.unit.conftest import write_yaml

    write_yaml(inv, _inv({"kimi_model_source": "local"}, {h: {**v, "kimi_hardware": A3} for h, v in hosts.items()}))
    yield inv, d
    stop.set()
    for t in transports:
        t.close()
    for s in listeners:
        s.close()


@pytest.mark.parametrize("command", [["status"], ["logs"], ["preflight", "--topology", "a3-pd"]])
def test_unreachable_hosts_are_one_line_each_never_a_traceback(unreachable_hosts, command: list[str]) -> None:
    import subprocess
    import sys

    inv, d = unreachable_hosts
    env = {"PATH": "/usr/bin:/bin", "HOME": str(d), "KIMICTL_STATE_DIR": str(d / "state")}
    r = subprocess.run([sys.executable, "-m", "kimictl", command[0], "-i", str(inv), *command[1:]],
                       check=False, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "paramiko" not in r.stderr, r.stderr
    if command[0] == "preflight":
        return  # one table row per host (SSH-001), checked by the preflight tests; no traceback is the point here
    text = r.stdout if command[0] == "status" else r.stderr
    lines = {h: [x for x in text.splitlines() if x.startswith(f"{h}: ") or x.startswith(f"error: {h}: ")]
             for h in ("h-closed", "h-garbage", "h-reset", "h-keyfile")}
    assert all(len(v) == 1 for v in lines.values()), text
    assert "Connection refused" in lines["h-closed"][0]
    assert "SSH protocol banner" in lines["h-garbage"][0]
    assert "reset" in lines["h-reset"][0].lower()
    assert f"cannot read {d}/missing_key: No such file or directory" in lines["h-keyfile"][0]


@pytest.mark.parametrize("which", ["inventory", "topology"])
def test_a_fifo_nobody_writes_is_refused_at_once(tmp_path: Path, which: str) -> None:
    """Opening a FIFO for reading waits for a writer: kimictl must not (issue 27's corpus: a hang)."""
    import os

    fifo = tmp_path / "x.yml"
    os.mkfifo(fifo)
    args = ["-i", str(fifo), "--topology", "a3-pd"] if which == "inventory" else \
        ["-i", str(BAD / "good-a3-2.yml"), "--topology", str(fifo)]
    result = _invoke(["validate", *args])
    assert result.exit_code == EXIT_INVALID, result.output
    assert f"{which} {fifo}: it is not a regular file" in result.stderr


@pytest.mark.parametrize("args", [["status", "-i", "{inv}", "--watch", "-1"],
                                  ["preflight", "-i", "{inv}", "--topology", "a3-pd", "--timeout", "-1"],
                                  ["deploy", "-i", "{inv}", "--topology", "a3-pd", "--check", "--ready-timeout", "-5"]])
def test_negative_durations_are_usage_errors(args: list[str]) -> None:
    """A negative --watch or --timeout crashed deep inside (sleep, paramiko): refused where it is parsed."""
    result = _invoke([a.replace("{inv}", str(REPO / "inventories" / "a3-pd.yml")) for a in args])
    assert result.exit_code == EXIT_INVALID, result.output
    assert "Invalid value for '--" in result.stderr
