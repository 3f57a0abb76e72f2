"""Bad-input corpus: every case goes through the real CLI and must exit 2 with a clear message, no traceback.

One table (CASES). Each case names an inventory and a topology: a file under tests/data/bad/, a preset name,
or (inventories only) python data written by inventory_factory.
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
    topology: str | None
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
]

COMMANDS = ("validate", "plan", "render")
JSON_CASES = ("unknown-key-did-you-mean", "yaml-syntax", "a2-pd-on-two-a2-hosts", "reserved-flag-port",
              "topology-did-you-mean", "proxy-port-in-kv-range", "removed-env", "share-zero")


def _path(name: str) -> Path:
    return BAD / name


@pytest.fixture
def resolve(inventory_factory):
    """(inventory path, topology argument or None, path of the file `at` refers to) for a case."""

    def run(case: Case) -> tuple[Path, str | None, Path | None]:
        inv = inventory_factory(case.inventory) if isinstance(case.inventory, dict) else _path(case.inventory)
        topo = case.topology
        if topo is not None and topo.endswith(".yml"):
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
