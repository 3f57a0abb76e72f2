"""Renderer: per-engine argv/env, kv-transfer JSON, container spec and proxy command, written from templates."""

from __future__ import annotations

import functools
import hashlib
import json
import shlex
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kimictl.errors import InvalidInput, RenderError
from kimictl.facts import engine_profile, hardware_catalogue, version_profile
from kimictl.inventory import Inventory
from kimictl.plan import Engine, Plan
from kimictl.resources import templates_dir
from kimictl.router_kinds import router_kind
from kimictl.topology import Topology

RENDER_SCHEMA_VERSION = 1
# Under a host's kimi_state_dir: the proxy front (shipped like the supervisor), its state, the clients' API key,
# the admin key of the routers' own API behind it.
PROXY_FRONT = "bin/proxy_front.py"
PROXY_FRONT_STATE = "run/proxy-front/state.json"
PROXY_API_KEY = "secrets/proxy-api-key"
PROXY_ADMIN_KEY = "secrets/proxy-admin-key"
# The engines' API key as an env file (VLLM_API_KEY=..., 0600), on every host when the plan keys its engines.
ENGINE_KEY_ENV = "secrets/engine-api-key.env"
# Next to proxy.sh in a release: runs a router copy's command inside the engines' image (container runtime).
PROXY_CONTAINER_SCRIPT = "router.container.sh"
# Engine-side shims of the lane's engine profile (they run inside the engine, e.g. kimictl_mooncake_cpu.py): deploy
# ships the one the plan's connector names to <kimi_state_dir>/bin/ with the supervisor.
ENGINE_SHIM_DIR = Path(__file__).parent / "sandbox"
ASCEND_CONTROL_DEVICES = ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")
# Host paths the vllm-ascend docs bind into every container, read-only:
# https://github.com/vllm-project/vllm-ascend/blob/releases/v0.23.0/docs/source/installation.md
ASCEND_MOUNTS = (
    "/usr/local/dcmi",
    "/usr/local/Ascend/driver/tools/hccn_tool",
    "/usr/local/bin/npu-smi",
    "/usr/local/Ascend/driver/lib64",
    "/usr/local/Ascend/driver/version.info",
    "/etc/ascend_install.info",
)


class RenderedEngine(Engine):
    """A planned engine with its whole command line and environment."""

    argv: list[str]
    env: dict[str, str]
    env_prepend: dict[str, str]
    preload: list[str] = Field(default_factory=list)  # LD_PRELOAD when the file exists where the engine runs


class RenderedProxy(BaseModel):
    model_config = ConfigDict(frozen=True)

    host: str
    host_name: str
    port: int
    router: str
    prefill: list[dict[str, Any]]
    decode: list[dict[str, Any]]
    argv: list[str]  # one router copy's command; kimictl's proxy front adds each copy's loopback ports
    routers: list[dict[str, int]] = []
    api_key: bool = False


class Rendered(BaseModel):
    """Everything `render` produces: the contract document (docs/contract.md) plus the files per host."""

    model_config = ConfigDict(frozen=True)

    plan: Plan
    engines: list[RenderedEngine]
    proxy: RenderedProxy | None
    files: dict[str, dict[str, str]]  # host -> relative path -> content
    releases: dict[str, str]  # host -> release id (hash of that host's files)

    def contract(self) -> dict[str, Any]:
        """`render --output json` (schema_version 1, see docs/contract.md)."""
        p = self.plan
        return {
            "schema_version": RENDER_SCHEMA_VERSION,
            "cluster": p.cluster,
            "topology": p.topology,
            "vllm_ascend_version": p.vllm_ascend_version,
            "image": p.image,
            "runtime": p.runtime,
            "engines": [
                {"id": e.id, "host": e.host, "ip": e.host_ip, "role": e.role, "instance": e.instance,
                 "dp_ranks": e.dp_ranks, "dp_size": e.dp_size, "tp_size": e.tp_size, "devices": e.devices,
                 "port": e.port, "serves_http": e.serves_http, "argv": e.argv, "env": e.env,
                 "env_prepend": e.env_prepend, "preload": e.preload}
                for e in self.engines
            ],
            "proxy": None if self.proxy is None else {
                "host": self.proxy.host, "host_name": self.proxy.host_name, "port": self.proxy.port,
                "router": self.proxy.router, "prefill": self.proxy.prefill, "decode": self.proxy.decode,
                "argv": self.proxy.argv, "routers": self.proxy.routers, "api_key": self.proxy.api_key,
            },
            "releases": self.releases,
        }


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _flag_items(serve: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for flag, value in serve.items():
        if value is True:
            out.append(f"--{flag}")
        elif isinstance(value, (dict, list)):
            out += [f"--{flag}", _json(value)]
        elif value is None or value is False:
            continue
        else:
            out += [f"--{flag}", str(value)]
    return out


def _fill(value: Any, **names: str) -> Any:
    """Replace {name} placeholders in the strings of a profile value (nested dicts and lists too)."""
    if isinstance(value, str):
        for k, v in names.items():
            value = value.replace("{" + k + "}", v)
        return value
    if isinstance(value, dict):
        return {k: _fill(v, **names) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, **names) for v in value]
    return value


def kv_transfer_config(plan: Plan, e: Engine) -> dict[str, Any] | None:
    """MooncakeConnectorV1 JSON: kv_port/engine_id per DP group, extra config with both sides' real sizes (or the
    engine profile's connector, e.g. NixlConnector; vLLM then names the engine afresh at each start, see
    data/engines/cpu-smoke.yml)."""
    if plan.mode != "pd":
        return None
    kv_role = "kv_producer" if e.role == "prefill" else "kv_consumer"
    picked = engine_profile(plan.engine_profile).connector(plan.kv_connector)
    if picked:
        kv = picked[1]
        cfg: dict[str, Any] = {"kv_connector": kv.kv_connector, "kv_role": kv_role, **kv.config}
        if kv.module:
            cfg["kv_connector_module_path"] = kv.module
        if kv.extra_config:
            cfg["kv_connector_extra_config"] = _fill(kv.extra_config, cluster=plan.cluster)
        return cfg
    ver = version_profile(plan.vllm_ascend_version)
    inst = plan.instance(e.instance)
    cfg = {"kv_connector": ver.kv_connector, "kv_role": kv_role, "kv_port": str(inst.kv_port),
           "engine_id": inst.engine_id}
    if ver.kv_connector_module_path:
        cfg["kv_connector_module_path"] = ver.kv_connector_module_path
    cfg["kv_connector_extra_config"] = {r: {"dp_size": plan.fits[r].dp, "tp_size": plan.fits[r].tp}
                                        for r in ("prefill", "decode")}
    return cfg


def connector_port(plan: Plan, e: Engine) -> int | None:
    """The port the engine profile's connector binds on this engine (the instance's kv_port + its DP rank)."""
    picked = engine_profile(plan.engine_profile).connector(plan.kv_connector) if plan.mode == "pd" else None
    kv_port = plan.instance(e.instance).kv_port
    if not picked or not picked[1].port or e.role not in picked[1].port.roles or kv_port is None:
        return None
    return kv_port + e.dp_ranks[0]


def engine_shims(plan: Plan) -> dict[str, str]:
    """{file name in <kimi_state_dir>/bin: source on the control node} of the shim the plan's connector loads."""
    picked = engine_profile(plan.engine_profile).connector(plan.kv_connector) if plan.mode == "pd" else None
    if not picked or not picked[1].module:
        return {}
    name = f"{picked[1].module}.py"
    return {name: str(ENGINE_SHIM_DIR / name)}


def engine_argv(plan: Plan, inv: Inventory, topo: Topology, e: Engine) -> list[str]:
    """The whole `vllm serve` line of one engine process (the engine profile names the command)."""
    host = inv.host(e.host)
    inst = plan.instance(e.instance)
    cfg = plan.role_config[e.role]
    prof = engine_profile(plan.engine_profile)
    cmd = shlex.split(host.kimi_engine_command or prof.command)
    bind = e.host_ip if plan.engine_bind == "host-ip" else "0.0.0.0"
    argv = [*cmd, *_fill(prof.serve_args, model_dir=plan.model_dir), "--host", bind, "--port", str(e.port)]
    argv += ["--data-parallel-size", str(e.dp_size)]
    if plan.launch == "external-dp":
        if e.dp_size > 1:  # vLLM refuses a DP rank (external load balancing) when the DP size is 1
            argv += ["--data-parallel-rank", str(e.dp_ranks[0])]
    else:
        argv += ["--data-parallel-size-local", str(len(e.dp_ranks))]
        if e.headless:
            argv += ["--headless", "--data-parallel-start-rank", str(e.dp_ranks[0])]
    argv += ["--data-parallel-address", inst.master_ip, "--data-parallel-rpc-port", str(inst.rpc_port)]
    argv += ["--tensor-parallel-size", str(e.tp_size), "--served-model-name", plan.served_model_name]
    argv += _flag_items(cfg.serve)
    argv += ["--allowed-local-media-path", inv.cluster.kimi_media_dir]
    if cfg.additional_config:
        argv += ["--additional-config", _json(cfg.additional_config)]
    if topo.speculative and inv.cluster.kimi_draft_model_dir:
        tokens = topo.speculative.num_speculative_tokens.get(e.role)  # type: ignore[call-overload]
        if tokens:
            argv += ["--speculative-config", _json({"method": topo.speculative.method,
                                                    "model": inv.cluster.kimi_draft_model_dir,
                                                    "num_speculative_tokens": tokens})]
    kv = kv_transfer_config(plan, e)
    if kv:
        argv += ["--kv-transfer-config", _json(kv)]
    return argv


def engine_env(plan: Plan, inv: Inventory, e: Engine) -> dict[str, str]:
    host = inv.host(e.host)
    env = dict(plan.role_config[e.role].env)
    nic = host.kimi_nic
    env.update({"GLOO_SOCKET_IFNAME": nic, "TP_SOCKET_IFNAME": nic, "VLLM_HOST_IP": host.ip})
    prof = engine_profile(plan.engine_profile)
    if prof.ascend:
        env.update({
            "HCCL_IF_IP": host.ip,
            "HCCL_SOCKET_IFNAME": nic,
            "ASCEND_RT_VISIBLE_DEVICES": ",".join(str(d) for d in e.devices),
        })
    picked = prof.connector(plan.kv_connector) if plan.mode == "pd" else None
    if picked:
        kv = picked[1]
        port = connector_port(plan, e)
        base = plan.instance(e.instance).kv_port
        # {port} exists only where this role binds one (e.g. not Mooncake's bootstrap port on decode)
        wanted = {k: v for k, v in kv.env.items() if port is not None or "{port" not in v}
        env.update(_fill(wanted, ip=host.ip, nic=nic, port=str(port), port_base=str(base)))
        if kv.module:  # the shim deploy ships next to the supervisor
            env["PYTHONPATH"] = f"{host.kimi_state_dir}/bin"
    return dict(sorted(env.items()))


def container_spec(plan: Plan, inv: Inventory, e: Engine) -> dict[str, Any]:
    hw = hardware_catalogue()[plan.hardware]
    c = inv.cluster
    mounts = [(p, p, "ro") for p in ASCEND_MOUNTS]
    if plan.mode == "pd":
        mounts.append(("/etc/hccn.conf", "/etc/hccn.conf", "ro"))
    mounts.append((c.kimi_model_dir, c.kimi_model_dir, "ro"))
    if c.kimi_draft_model_dir:
        mounts.append((c.kimi_draft_model_dir, c.kimi_draft_model_dir, "ro"))
    mounts.append((c.kimi_media_dir, c.kimi_media_dir, "ro"))
    return {
        "name": f"kimi-{plan.cluster}-{e.id}",
        "image": plan.image,
        "shm_size": "1g",
        "devices": [f"/dev/davinci{i}" for i in range(hw.npus)] + list(ASCEND_CONTROL_DEVICES),
        "mounts": mounts,
    }


def proxy_argv(plan: Plan, inv: Inventory) -> list[str]:
    """One router copy's command, per router kind (data/routers.yml), one entry per DP-rank endpoint; the proxy
    front appends each copy's loopback --host/--port (and metrics port flag, for a kind that has one)."""
    p = plan.proxy
    assert p is not None
    host = inv.host(p.host)
    kind = router_kind(p.router)
    picked = engine_profile(plan.engine_profile).connector(plan.kv_connector)
    needs = picked[1].routers[p.router] if picked else None  # what this router needs for the profile's connector
    if kind.name == "vllm-router":
        argv = [*shlex.split(host.kimi_router_command or "vllm-router"), "--policy", str(p.policy),
                "--vllm-pd-disaggregation", *(needs.args if needs else [])]
        engines = {e.id: e for e in plan.engines}
        for ep in p.prefill:
            argv += ["--prefill", f"http://{ep.ip}:{ep.port}"]
            if needs and needs.prefill_bootstrap_port:
                argv.append(str(connector_port(plan, engines[ep.engine])))
        for ep in p.decode:
            argv += ["--decode", f"http://{ep.ip}:{ep.port}"]
        return argv + kind.args
    if plan.runtime == "container":  # the script in the engines' image (same version), run by router.container.sh
        cmd = ["bash", f"./{PROXY_CONTAINER_SCRIPT}", "python3", kind.image_script]
    else:
        assert host.kimi_proxy_script, "the planner requires kimi_proxy_script on kimi_runtime host"
        cmd = [*shlex.split(host.kimi_proxy_python), host.kimi_proxy_script]
    return [*cmd,
            "--prefiller-hosts", *(ep.ip for ep in p.prefill), "--prefiller-ports", *(str(ep.port) for ep in p.prefill),
            "--decoder-hosts", *(ep.ip for ep in p.decode), "--decoder-ports", *(str(ep.port) for ep in p.decode),
            *kind.args, *(needs.args if needs else [])]


def engine_id_urls(plan: Plan) -> list[str]:
    """Where the proxy's router learns the prefill engines' ids once, at its start (the proxy front watches them)."""
    p = plan.proxy
    picked = engine_profile(plan.engine_profile).connector(plan.kv_connector) if p else None
    path = picked[1].routers[p.router].engine_ids_at_start if picked and p else None
    if not path:
        return []
    engines = {e.id: e for e in plan.engines}
    return [f"http://{ep.ip}:{connector_port(plan, engines[ep.engine])}{path}" for ep in p.prefill]


def front_argv(plan: Plan, inv: Inventory) -> list[str]:
    """The proxy process: kimictl's front on the proxy port, the router copies behind it."""
    p = plan.proxy
    assert p is not None
    sd = inv.host(p.host).kimi_state_dir
    kind = router_kind(p.router)
    argv = ["python3", f"{sd}/{PROXY_FRONT}", "run", "--listen", f"0.0.0.0:{p.port}", "--state",
            f"{sd}/{PROXY_FRONT_STATE}"]
    for r in p.routers:
        argv += ["--router", f"{r.port}:{r.metrics_port}"]
    if kind.health_path != "/health":  # the front's checks of its copies, and what the proxy port's /health asks
        argv += ["--router-health", kind.health_path]
    if kind.metrics_flag is None:
        argv += ["--no-router-metrics"]
    for url in engine_id_urls(plan):
        argv += ["--watch", url]
    if p.api_key:
        argv += ["--api-key-file", f"{sd}/{PROXY_API_KEY}"]
    if p.admin_key:
        argv += ["--admin-key-file", f"{sd}/{PROXY_ADMIN_KEY}"]
    lim = p.limits
    argv += ["--max-connections", str(lim.max_connections), "--max-body", str(lim.max_body_mib * 2**20),
             "--header-timeout", str(lim.header_timeout_s), "--io-timeout", str(lim.io_timeout_s),
             "--idle-timeout", str(lim.idle_timeout_s)]
    return [*argv, "--", *proxy_argv(plan, inv)]


@functools.cache
def _jinja():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["sh"] = lambda v: shlex.quote(str(v))
    env.filters["argv_lines"] = argv_lines
    return env


def argv_lines(argv: list[str]) -> str:
    """Quote an argv for a script, one flag (with its value) per continued line."""
    lines: list[list[str]] = []
    for i, item in enumerate(argv):
        if i == 0 or (item.startswith("--") and i > 2):
            lines.append([])
        lines[-1].append(shlex.quote(item))
    return " \\\n  ".join(" ".join(line) for line in lines)


def render_template(name: str, **ctx: Any) -> str:
    import jinja2

    try:
        return _jinja().get_template(name).render(**ctx)
    except jinja2.TemplateError as exc:
        raise RenderError(f"template {name} failed: {exc}") from exc


def release_id(files: dict[str, str]) -> str:
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.encode() + b"\0" + files[path].encode() + b"\0")
    return h.hexdigest()[:16]


def render(plan: Plan, inv: Inventory, topo: Topology) -> Rendered:
    """Render every engine and the proxy; deterministic (same input, byte-identical output)."""
    engines: list[RenderedEngine] = []
    files: dict[str, dict[str, str]] = {h.name: {} for h in inv.hosts if h.name in plan.host_roles}
    for e in plan.engines:
        argv = engine_argv(plan, inv, topo, e)
        env = engine_env(plan, inv, e)
        prepend = plan.role_config[e.role].env_prepend
        preload = plan.role_config[e.role].preload
        engines.append(RenderedEngine(**e.model_dump(), argv=argv, env=env, env_prepend=prepend, preload=preload))
        key_env = f"{inv.host(e.host).kimi_state_dir}/{ENGINE_KEY_ENV}" if plan.engine_api_key else None
        ctx = {"plan": plan, "engine": e, "env": env, "env_prepend": prepend, "preload": preload, "argv": argv,
               "key_env": key_env}
        out = files[e.host]
        out[f"engines/{e.id}.env"] = render_template("engine.env.j2", **ctx)
        out[f"engines/{e.id}.sh"] = render_template("engine.sh.j2", **ctx)
        if plan.runtime == "container":
            out[f"engines/{e.id}.container.sh"] = render_template(
                "engine.container.sh.j2", **ctx, container=container_spec(plan, inv, e))

    proxy = None
    if plan.proxy:
        p = plan.proxy
        proxy = RenderedProxy(
            host=p.ip, host_name=p.host, port=p.port, router=p.router,
            prefill=[{"host": x.ip, "port": x.port, "engine": x.engine} for x in p.prefill],
            decode=[{"host": x.ip, "port": x.port, "engine": x.engine} for x in p.decode], argv=proxy_argv(plan, inv),
            routers=[r.model_dump() for r in p.routers], api_key=p.api_key)
        kind = router_kind(p.router)
        key_env = f"{inv.host(p.host).kimi_state_dir}/{ENGINE_KEY_ENV}" if plan.engine_api_key else None
        files[p.host]["proxy/proxy.sh"] = render_template("proxy.sh.j2", plan=plan, proxy=p, kind=kind,
                                                          argv=front_argv(plan, inv), key_env=key_env)
        if kind.image_root and plan.runtime == "container":
            files[p.host][f"proxy/{PROXY_CONTAINER_SCRIPT}"] = render_template(
                "router.container.sh.j2", plan=plan, proxy=p, container=f"kimi-{plan.cluster}-proxy-copy")

    releases: dict[str, str] = {}
    for host, out in files.items():
        releases[host] = release_id(out)
        manifest = {
            "cluster": plan.cluster, "topology": plan.topology, "host": host, "release": releases[host],
            "runtime": plan.runtime, "vllm_ascend_version": plan.vllm_ascend_version, "image": plan.image,
            "served_model_name": plan.served_model_name,
            "engines": [
                {"id": e.id, "role": e.role, "port": e.port, "serves_http": e.serves_http, "devices": e.devices,
                 "command": ["bash", f"engines/{e.id}.container.sh" if plan.runtime == "container"
                             else f"engines/{e.id}.sh"]}
                for e in plan.engines if e.host == host
            ],
            "proxy": None if not (plan.proxy and plan.proxy.host == host) else
            {"port": plan.proxy.port, "command": ["bash", "proxy/proxy.sh"], "routers": len(plan.proxy.routers),
             "api_key": plan.proxy.api_key, "admin_key": plan.proxy.admin_key, "router": plan.proxy.router},
        }
        out["manifest.json"] = render_template("manifest.json.j2", manifest=manifest)
    return Rendered(plan=plan, engines=engines, proxy=proxy, files=files, releases=releases)


def check_out_dir(out_dir: Path) -> None:
    """`--out DIR` must be a directory or creatable as one (exit 2 before anything is written)."""
    for p in (out_dir, *out_dir.absolute().parents):
        if p.exists():
            if not p.is_dir():
                raise InvalidInput(f"--out {out_dir}: {p} exists and is not a directory",
                                   hint="give a directory (it is created when missing)")
            return


def write_rendered(rendered: Rendered, out_dir: Path) -> list[Path]:
    """Write each host's files under out_dir/<host>/ and the contract document as out_dir/render.json."""
    written: list[Path] = []
    for host, files in rendered.files.items():
        for rel, content in files.items():
            path = out_dir / host / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
            if rel.endswith(".sh"):
                path.chmod(0o755)
            written.append(path)
    doc = out_dir / "render.json"
    doc.write_text(json.dumps(rendered.contract(), indent=2) + "\n")
    written.append(doc)
    return written
