"""Recipe parity: kimictl renders what vllm-ascend's own CI runs, except its listed deviations.

Every Kimi P/D recipe in the pinned 0.23.0.post1 sdist is imported (`kimictl topology import`), planned and rendered
on a generated inventory of `num_nodes` hosts; vllm-ascend's own CI harness (run from the sdist) expands the same
recipe into per-rank `vllm serve` commands and environments for the same host IPs. Per engine, flags (compared flag
by flag; JSON values as JSON) and env must be equal once each difference is explained by a deviation of
kimictl/data/deviations.yml; the facts a deviation rests on are checked against the sdist's source here too.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from upstream_sdist import PINS, recipe_paths, sdist, source_keys

from kimictl.facts import deviations, hardware_catalogue, model_facts, version_profile
from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.recipe import import_recipe
from kimictl.render import render
from kimictl.topology import load_topology

RELEASE = PINS["recipes"]["release"]
VERSION = version_profile(RELEASE)
NIC = "enp189s0f0"
MODEL_DIR = "/data/models/kimi"
DRAFT_DIR = "/data/models/draft"
MEDIA_DIR = "/var/lib/kimi/media"
JSON_FLAGS = ("--kv-transfer-config", "--additional-config", "--speculative-config", "--compilation-config")
PRESET_ADDITIONS = {"--tool-call-parser": "tool-parsers", "--reasoning-parser": "tool-parsers",
                    "--enable-auto-tool-choice": "tool-parsers", "--mm-encoder-tp-mode": "mm-encoder-dp",
                    "--safetensors-load-strategy": "load-prefetch"}


def _ips(n: int) -> list[str]:
    return [f"192.168.100.{11 + i}" for i in range(n)]


@pytest.fixture(scope="module")
def upstream() -> dict[str, list[dict[str, Any]]]:
    """Recipe file name -> vllm-ascend's harness expansion of it (one row per rank)."""
    root = sdist(RELEASE)
    paths = recipe_paths()
    req = {"recipes": {str(p): _ips(yaml.safe_load(p.read_text())["num_nodes"]) for p in paths}, "nic": NIC}
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "upstream_expand.py")], input=json.dumps(req),
                          capture_output=True, text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {Path(k).name: v for k, v in json.loads(proc.stdout).items()}


def _inventory(tmp_path: Path, n: int, model_id: str, draft: bool, roles: dict[int, str] | None = None) -> Path:
    """n A3 hosts node-0.. at the IPs the upstream expansion used; roles pins hosts (recipe node -> role)."""
    hosts = {f"node-{i}": {"ansible_host": ip, "kimi_hardware": "atlas-800-a3",
                           **({"kimi_role": roles[i]} if roles else {})} for i, ip in enumerate(_ips(n))}
    all_vars = {"kimi_cluster": "parity", "kimi_model_dir": MODEL_DIR, "kimi_model_id": model_id,
                "kimi_vllm_ascend_version": RELEASE, "kimi_runtime": "container", "kimi_nic": NIC,
                "kimi_media_dir": MEDIA_DIR, **({"kimi_draft_model_dir": DRAFT_DIR} if draft else {})}
    path = tmp_path / f"inventory-{n}.yml"
    path.write_text(yaml.safe_dump({"all": {"vars": all_vars, "hosts": hosts}}))
    return path


def _flags(argv: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        flag = argv[i]
        assert flag.startswith("--"), argv
        value: Any = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else True
        out[flag] = json.loads(value) if flag in JSON_FLAGS else value
        i += 1 if value is True else 2
    return out


class SourceFacts:
    """What the deviations rest on, read from the release's source (ast and text, never imported)."""

    def __init__(self, root: Path) -> None:
        pkg = root / "vllm_ascend"
        self.keys = source_keys(RELEASE)
        # _get_config_value(additional_config, "key", "ENV", ...): the env var is the key's fallback spelling.
        self.env_key: dict[str, str] = {}
        for n in ast.walk(ast.parse((pkg / "ascend_config.py").read_text())):
            if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "_get_config_value" and len(n.args) >= 3:
                key, env = (a.value for a in n.args[1:3] if isinstance(a, ast.Constant))
                self.env_key[env] = key
        utils = (pkg / "attention" / "utils.py").read_text()
        body = utils[utils.index("def enabling_mlapo"):].split("\ndef ", 1)[0]
        self.mlapo_consumer_only = "is_kv_consumer" in body and "is_kv_producer" in body
        self.reads_use_ascend_direct = any("use_ascend_direct" in p.read_text() for p in pkg.rglob("*.py"))


@pytest.fixture(scope="module")
def facts() -> SourceFacts:
    return SourceFacts(sdist(RELEASE))


class Parity:
    """Compares one recipe's upstream ranks with kimictl's engines; records the deviations it needed."""

    def __init__(self, facts: SourceFacts, model_id: str, served: str, topo_draft: str | None, preset: bool) -> None:
        self.facts, self.model_id, self.served, self.topo_draft, self.preset = facts, model_id, served, topo_draft, \
            preset
        self.used: set[str] = set()
        self.kv: list[tuple[tuple[str, str], tuple[str, str]]] = []
        self.problems: list[str] = []

    def engine(self, label: str, up: dict[str, Any], argv: list[str], env: dict[str, str], host_ip: str,
               extras: dict[str, Any]) -> None:
        uf, kf = _flags(up["argv"][3:]), _flags(argv[3:])
        ue, ke = dict(up["env"]), dict(env)
        assert up["argv"][:2] == argv[:2] == ["vllm", "serve"]
        # model-path: the hub id there, the staged directory here.
        assert up["argv"][2] == self.model_id and argv[2] == MODEL_DIR
        assert ue.pop("VLLM_USE_MODELSCOPE", "true") == "true"
        self.used.add("model-path")
        if uf.get("--data-parallel-size") == "1":
            assert uf.pop("--data-parallel-rank") == "0" and "--data-parallel-rank" not in kf
            self.used.add("dp-rank-at-dp1")
        assert kf.pop("--served-model-name") == self.served
        self.used.add("served-model-name")
        assert uf.pop("--allowed-local-media-path", "/") == "/" and kf.pop("--allowed-local-media-path") == MEDIA_DIR
        self.used.add("media-path")
        ukv, kkv = uf["--kv-transfer-config"], kf["--kv-transfer-config"]
        self.kv.append(((ukv.pop("kv_port"), ukv.pop("engine_id")), (kkv.pop("kv_port"), kkv.pop("engine_id"))))
        self.used |= {"kv-port", "engine-id"}
        if ukv["kv_connector_extra_config"].pop("use_ascend_direct", None) is not None:
            assert not self.facts.reads_use_ascend_direct
            self.used.add("use-ascend-direct")
        if "--speculative-config" in uf or "--speculative-config" in kf:
            us, ks = uf["--speculative-config"], kf["--speculative-config"]
            assert us.pop("model") == self.topo_draft and ks.pop("model") == DRAFT_DIR
            self.used.add("draft-path")
        self._additional_config(uf, ue, kf, up["role"])
        for key, dev in (("VLLM_SERVER_DEV_MODE", "dev-mode"), ("SERVER_PORT", "harness-env"),
                         ("LOCAL_IP", "harness-env"), ("NIC_NAME", "harness-env"), ("MASTER_IP", "harness-env")):
            if key in ue:
                value = ue.pop(key)
                assert key != "SERVER_PORT" or value == uf["--port"]
                self.used.add(dev)
        assert ke.pop("VLLM_HOST_IP") == host_ip
        self.used.add("host-ip")
        assert uf.pop("--host") == "0.0.0.0" and kf.pop("--host") == host_ip
        self.used.add("engine-bind")
        for key in ("HCCL_EXEC_TIMEOUT", "HCCL_CONNECT_TIMEOUT"):
            if key not in ue and key in ke:
                assert ke.pop(key) == VERSION.env[key]
                self.used.add("hccl-timeouts")
        if extras["env_prepend"]:
            assert extras["env_prepend"] == VERSION.env_prepend
            self.used.add("mooncake-lib-path")
        if extras["preload"]:
            assert extras["preload"] == VERSION.preload
            self.used.add("jemalloc")
        if self.preset:
            for flag, dev in PRESET_ADDITIONS.items():
                if flag in kf and flag not in uf:
                    kf.pop(flag)
                    self.used.add(dev)
        for what, a, b in (("flag", uf, kf), ("env", ue, ke)):
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    self.problems.append(f"{label}: {what} {key}: upstream {a.get(key)!r}, kimictl {b.get(key)!r}")

    def _additional_config(self, uf: dict[str, Any], ue: dict[str, str], kf: dict[str, Any], role: str) -> None:
        """Upstream's env spellings become its additional-config keys (the key wins, as _get_config_value does);
        keys the release does not read, and MLAPO off decode, do nothing there."""
        up = uf.pop("--additional-config", {})
        for env, key in self.facts.env_key.items():
            if env in ue:
                value = int(ue.pop(env))
                up.setdefault(key, value)
                self.used.add("switch-spelling")
        for key in list(up):
            if key not in self.facts.keys.additional_config:
                del up[key]
                self.used.add("unread-additional-config")
        if role == "prefiller" and "enable_mlapo" in up:
            assert self.facts.mlapo_consumer_only
            del up["enable_mlapo"]
            self.used.add("switch-not-for-role")
        if up:
            uf["--additional-config"] = up
        mine = kf.pop("--additional-config", {})
        if mine:
            kf["--additional-config"] = mine

    def finish(self, min_port: int) -> None:
        """kv_port/engine_id group the engines exactly as upstream's do, from the hardware's floor."""
        ups, mine = [u for u, _ in self.kv], [k for _, k in self.kv]
        same = {(a, b) for a in range(len(ups)) for b in range(len(ups)) if ups[a] == ups[b]}
        same_k = {(a, b) for a in range(len(mine)) for b in range(len(mine)) if mine[a] == mine[b]}
        if same != same_k:
            self.problems.append("kv_port/engine_id group the engines differently from upstream")
        if len({p for p, _ in mine}) != len(set(mine)) or min(int(p) for p, _ in mine) < min_port:
            self.problems.append(f"kv_ports {sorted({p for p, _ in mine})} below {min_port} or shared by instances")


def _compare(upstream_rows: list[dict[str, Any]], rendered, inv, parity: Parity) -> None:
    index = {h.name: i for i, h in enumerate(inv.hosts)}
    mine = {(index[e.host], e.dp_ranks[0]): e for e in rendered.engines}
    ups = {(r["node"], r["dp_rank"]): r for r in upstream_rows}
    assert sorted(mine) == sorted(ups), "kimictl's engines are not upstream's ranks"
    for key, row in ups.items():
        e = mine[key]
        assert {"prefiller": "prefill", "decoder": "decode"}[row["role"]] == e.role
        parity.engine(e.id, row, e.argv, e.env, e.host_ip, {"env_prepend": e.env_prepend, "preload": e.preload})
    parity.finish(hardware_catalogue()[rendered.plan.hardware].kv_port_min)


def _report(name: str, parity: Parity, engines: int) -> str:
    state = "parity" if not parity.problems else f"DIFFERS ({len(parity.problems)})"
    return f"{name}: {state}, {engines} engines; deviations: {', '.join(sorted(parity.used))}"


def test_every_kimi_recipe_imports_and_renders_as_upstream(upstream, facts, tmp_path: Path, capsys) -> None:
    lines, problems = [], []
    paths = recipe_paths()
    assert len(paths) >= 10, [p.name for p in paths]  # K2.5 16k/128k, K2.6 x4, K2.7 x4 in 0.23.0.post1
    for path in paths:
        result = import_recipe(path, version=RELEASE)
        topo_path = tmp_path / f"{result.topology['name']}.yml"
        topo_path.write_text(result.yaml())
        topo = load_topology(str(topo_path))
        draft = topo.speculative is not None
        recipe = yaml.safe_load(path.read_text())
        roles = {i: {"prefiller": "prefill", "decoder": "decode"}[g]
                 for g, nodes in recipe["routing"]["groups"].items() for i in nodes}
        inv = load_inventory(_inventory(tmp_path, result.hosts, result.model_id, draft, roles))
        rendered = render(make_plan(inv, topo), inv, topo)
        parity = Parity(facts, result.model_id, rendered.plan.served_model_name,
                        topo.speculative.model_id if draft else None, preset=False)
        _compare(upstream[path.name], rendered, inv, parity)
        assert parity.used <= set(deviations()), parity.used - set(deviations())
        # the import lists every deviation the comparison needed
        assert parity.used <= {d.id for d in result.deviations}, parity.used - {d.id for d in result.deviations}
        lines.append(_report(path.name, parity, len(rendered.engines)))
        problems += parity.problems
    ok = sum(1 for line in lines if ": parity," in line)
    with capsys.disabled():
        print("\nrecipe parity (vllm-ascend " + RELEASE + "):\n  " + "\n  ".join(lines) + f"\n  {ok}/{len(lines)}")
    assert not problems, "\n".join(problems)
    assert ok == len(lines)


def test_a3_pd_2p1d_renders_as_the_k25_16k_recipe(upstream, facts, tmp_path: Path, capsys) -> None:
    """The preset is the K2.5 16k weekly recipe on four A3 hosts, except listed deviations."""
    name = "Kimi-K2.5-W4A8-16k-1k-TPOT50.yaml"
    topo = load_topology("a3-pd-2p1d")
    model = model_facts()
    inv = load_inventory(_inventory(tmp_path, 4, model.model_id, True))
    plan = make_plan(inv, topo)
    assert [(i.name, i.hosts, i.dp, i.tp) for i in plan.instances] == [
        ("prefill-0", ["node-0"], 2, 8), ("prefill-1", ["node-1"], 2, 8), ("decode-0", ["node-2", "node-3"], 32, 1)]
    parity = Parity(facts, model.model_id, model.served_model_name, topo.speculative.model_id, preset=True)
    _compare(upstream[name], render(plan, inv, topo), inv, parity)
    with capsys.disabled():
        print("\n  " + _report(f"a3-pd-2p1d vs {name}", parity, len(plan.engines)))
    assert parity.used <= set(deviations())
    assert not parity.problems, "\n".join(parity.problems)
