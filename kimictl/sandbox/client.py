"""Client-side files of a sandbox: the Ansible inventory and the OpenSSH client config (pure renderers)."""

from __future__ import annotations

from pathlib import Path

import yaml

from kimictl.ansible import control_socket_dir
from kimictl.sandbox.layout import CONTROL_NIC, ENGINE_COMMAND, MODEL_DIR, HostSpec

MODEL_ID = "Eco-Tech/Kimi-K2.5-W4A8"
CONTROL_NAME = 26   # the ssh_config's ControlPath adds "/<host>-<port>" (e.g. "/127.10.7.32-22732"), with room


def control_dir(directory: Path) -> Path:
    """Where ControlMaster sockets go: D/cp, or a short private /tmp dir when D/cp is too long for a socket path."""
    return control_socket_dir(directory / "cp", CONTROL_NAME)


def ssh_common_args(directory: Path) -> str:
    # strict host-key checking stays on: known_hosts holds the real generated host keys
    return " ".join([
        f"-o UserKnownHostsFile={directory / 'known_hosts'}",
        "-o StrictHostKeyChecking=yes",
        "-o IdentitiesOnly=yes",
        "-o ControlMaster=auto",
        "-o ControlPersist=30s",
        f"-o ControlPath={control_dir(directory)}/%h-%p",
    ])


def host_python(module: str) -> str | None:
    """The hosts' system python with this venv's site-packages (the venv's interpreter may sit under /root,
    which is a fresh tmpfs on sandbox hosts); None when `module` is not installed here."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return None
    site = Path(spec.origin).parent.parent
    return f"env PYTHONPATH={site} /usr/bin/python3"


def router_command() -> str | None:
    """vllm-router from this venv, run by the hosts' system python; None when vllm-router is not installed."""
    py = host_python("vllm_router")
    return f"{py} -m vllm_router.launch_router" if py else None


def proxy_python() -> str | None:
    """The hosts' system python with this venv's site-packages when it has what vllm-ascend's P/D proxy imports."""
    from kimictl.router_kinds import router_kind

    modules = router_kind("vllm-ascend-proxy").python_modules
    pythons = {host_python(m) for m in modules}
    return pythons.pop() if len(pythons) == 1 and None not in pythons else None


def inventory(hosts: list[HostSpec], hardware: str, directory: Path, *, mode: str, cluster: str,
              model_dir: str = MODEL_DIR, engine_command: str = ENGINE_COMMAND, user: str = "root",
              hub_url: str | None = None, python: str = "/usr/bin/python3", proxy_script: str | None = None) -> dict:
    """The Ansible YAML inventory as a dict; the checkpoint comes from the sandbox's fake hub when it runs.
    proxy_script: where the hosts have vllm-ascend's P/D proxy (None: it could not be had, see `sandbox up`)."""
    hub = {"kimi_model_source": "modelscope", "kimi_model_id": MODEL_ID, "kimi_model_endpoint": hub_url,
           **({"kimi_python": host_python("modelscope")} if host_python("modelscope") else {})}
    all_vars = {
        "kimi_cluster": cluster,
        "kimi_model_dir": model_dir,
        **(hub if hub_url else {"kimi_model_source": "local"}),
        "kimi_runtime": "host",
        "kimi_nic": CONTROL_NIC if mode == "netns" else "lo",
        "kimi_engine_command": engine_command,
        # loopback hosts share this machine's network namespace and /etc: leave its sysctls alone
        **({"kimi_reserve_ports": False} if mode == "loopback" else {}),
        **({"kimi_router_command": router_command()} if router_command() else {}),
        **({"kimi_proxy_script": proxy_script, "kimi_proxy_python": proxy_python()}
           if proxy_script and proxy_python() else {}),
        "ansible_user": user,
        "ansible_python_interpreter": python,
        "ansible_ssh_private_key_file": str(directory / "id_ed25519"),
        "ansible_ssh_common_args": ssh_common_args(directory),
        # ansible puts its own ControlPath first on the ssh command line; keep those sockets in D too
        "ansible_control_path_dir": str(control_dir(directory)),
    }
    host_vars = {}
    for h in hosts:
        hv: dict = {"ansible_host": h.ip}
        if mode != "netns":
            hv["ansible_port"] = h.port
            hv["kimi_state_dir"] = h.state_dir
        hv["kimi_hardware"] = hardware
        hv["kimi_device_ips"] = list(h.device_ips)
        host_vars[h.name] = hv
    return {"all": {"vars": all_vars, "hosts": host_vars}}


class _Dumper(yaml.SafeDumper):
    """Block mappings, but lists of scalars (device IPs) on one flow line."""


def _list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(not isinstance(x, (list, dict)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _list)


def inventory_yaml(doc: dict) -> str:
    head = ("# Written by `kimictl sandbox up`; removed by `kimictl sandbox down`.\n"
            "# Hosts are simulated Atlas servers on this machine (see docs/sandbox.md).\n")
    return head + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def ssh_config(hosts: list[HostSpec], directory: Path, user: str = "root") -> str:
    """`ssh -F D/ssh_config atlas-01 ...` works with strict host-key checking."""
    lines = []
    for h in hosts:
        lines += [f"Host {h.name}", f"  HostName {h.ip}", f"  Port {h.port}", ""]
    lines += [
        "Host *",
        f"  User {user}",
        f"  IdentityFile {directory / 'id_ed25519'}",
        "  IdentitiesOnly yes",
        f"  UserKnownHostsFile {directory / 'known_hosts'}",
        "  StrictHostKeyChecking yes",
        "  BatchMode yes",
        "  ConnectTimeout 5",
        "  ControlMaster auto",
        f"  ControlPath {control_dir(directory)}/%h-%p",
        "  ControlPersist 30s",
        "",
    ]
    return "\n".join(lines)


def known_hosts_line(host: HostSpec, pubkey: str) -> str:
    name = host.ip if host.port == 22 else f"[{host.ip}]:{host.port}"
    key = " ".join(pubkey.split()[:2])
    return f"{name} {key}\n"
