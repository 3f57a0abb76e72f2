"""Run playbooks with ansible-runner: build the run spec (pure), run it, report per-host results from events.

Secrets stay out of ansible-runner's reach: each playbook run has its own private data directory (0700); extravars
go to a 0600 file there that is removed when the run ends, never to the command line; ansible-playbook gets only
the environment it needs (runner writes the whole environment into artifacts/<ident>/command, and ours may hold
hub tokens). Tasks that handle a secret take it on stdin or from a file, with no_log.

Extra vars are data, never templates: some carry what a host reported (process ids, an old command, a release
name), and ansible-core templates extra vars on the control node, so every string in the extravars file carries
Ansible's `!unsafe` tag (`extravars_yaml`); `{{ kimi.x }}` in a task still yields the value, never evaluated."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimictl.errors import KimictlError
from kimictl.resources import playbooks_dir


@dataclass(frozen=True)
class RunSpec:
    """Everything one ansible-runner invocation needs; built without side effects so tests compare it."""

    private_data_dir: str
    playbook: str
    inventory: str
    extravars: dict[str, Any]
    ident: str
    limit: str | None
    forks: int
    envvars: dict[str, str]
    cmdline: str | None = None


SUN_PATH_MAX = 107            # bytes of a unix socket path (sun_path is 108 with its NUL)
SSH_BIND_SUFFIX = 17          # ssh binds a ControlMaster socket as "<path>.<16 random chars>", then renames it
ANSIBLE_CONTROL_NAME = 11     # ansible's ControlPath is "<dir>/<10 hex of a hash>"


def control_socket_dir(preferred: Path, name_len: int = ANSIBLE_CONTROL_NAME) -> Path:
    """Where SSH ControlMaster sockets go: `preferred`, unless a socket path under it (`name_len` more bytes, plus
    ssh's temporary suffix while binding) would not fit in a unix socket address; then /tmp/kimictl-cp-<hash of
    preferred> (made private by `make_private_dir`). A too-long path makes every ssh connection fail, and Ansible
    reports only UNREACHABLE."""
    if len(os.fsencode(str(preferred))) + name_len + SSH_BIND_SUFFIX <= SUN_PATH_MAX:
        return preferred
    return Path("/tmp") / f"kimictl-cp-{hashlib.sha256(os.fsencode(str(preferred))).hexdigest()[:12]}"


def _private(path: Path) -> bool:
    """A directory (not a symlink) of this user that nobody else can use."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def make_private_dir(path: Path) -> Path:
    """Create `path` (mode 0700), or accept it when it exists as a private directory of ours; refuse a symlink or a
    directory someone else made (in a shared /tmp)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _private(path):
        raise KimictlError(f"{path} is not a private directory of this user (it is for SSH control sockets)",
                           hint=f"remove {path}, or set KIMICTL_STATE_DIR to a shorter path")
    return path


def build_run_spec(run_dir: Path, playbook: str, inventory: Path, extravars: dict[str, Any], *, ident: str,
                   hosts: list[str], limit: list[str] | None = None, check: bool = False,
                   host_key_args: str = "") -> RunSpec:
    """host_key_args: OpenSSH options with the known_hosts files and policy (kimictl.ssh.ansible_host_key_args)."""
    control = control_socket_dir(run_dir / "cp")
    return RunSpec(
        private_data_dir=str(run_dir / "ansible" / ident),
        playbook=str(playbooks_dir() / playbook),
        inventory=str(Path(inventory).resolve()),
        extravars=extravars,
        ident=ident,
        limit=",".join(limit) if limit else None,
        forks=max(5, len(hosts)),
        envvars={
            "ANSIBLE_HOST_KEY_CHECKING": "True",
            "ANSIBLE_PIPELINING": "True",
            # Multiplexed SSH: sockets in a directory kimictl owns and closes when the deploy ends.
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(control),
            "ANSIBLE_SSH_ARGS": " ".join(filter(None, [host_key_args,
                                                       "-C -o ControlMaster=auto -o ControlPersist=120s"])),
            "ANSIBLE_RETRY_FILES_ENABLED": "False",
            "ANSIBLE_DEPRECATION_WARNINGS": "False",
            "ANSIBLE_LOCALHOST_WARNING": "False",
            "ANSIBLE_PYTHON_INTERPRETER": "auto_silent",
        },
        cmdline="--check --diff" if check else None,
    )


@dataclass
class HostFailure:
    host: str
    task: str
    message: str


@dataclass
class PlaybookResult:
    status: str
    rc: int
    failures: list[HostFailure] = field(default_factory=list)
    changed: dict[str, int] = field(default_factory=dict)
    artifacts: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "successful" and self.rc == 0 and not self.failures


def _failure_message(res: dict[str, Any]) -> str:
    parts = [str(res.get("msg") or "")]
    for key in ("stderr", "stdout"):
        text = (res.get(key) or "").strip()
        if text:
            parts.append(f"{key}: {text[-800:]}")
    return "\n".join(p for p in parts if p).strip() or json.dumps(res)[:800]


# Of kimictl's own environment, ansible-playbook and ssh get only these (and ANSIBLE_* settings that hold no secret).
PASS_ENV = frozenset({"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR",
                      "SSH_AUTH_SOCK", "KRB5CCNAME", "XDG_RUNTIME_DIR", "PYTHONPATH", "VIRTUAL_ENV"})
_SECRET_NAME = re.compile(r"PASS|SECRET|TOKEN|KEY|CRED|AUTH", re.I)


def _passes(name: str) -> bool:
    if name in PASS_ENV or name.startswith("LC_"):
        return True
    return name.startswith("ANSIBLE_") and (name.endswith("_FILE") or not _SECRET_NAME.search(name))


def runner_env(env: Mapping[str, str], own: Mapping[str, str], outer: Mapping[str, str]) -> dict[str, str]:
    """ansible-runner seeds the job's environment with all of `outer` (ours): keep what runner and `own` (the spec's
    envvars) set, and of the rest only what passes."""
    return {k: v for k, v in env.items() if k in own or outer.get(k) != v or _passes(k)}


STALE_EXTRAVARS_S = 600   # ansible-playbook reads its extravars when it starts; older ones were left by a killed run


def _remove_stale_extravars(runs: Path) -> None:
    """A kimictl that was killed mid-playbook leaves its extravars file (which may hold a secret); the next playbook
    run of the cluster removes it."""
    cutoff = time.time() - STALE_EXTRAVARS_S
    for p in runs.glob("*/ansible/*/env/extravars"):
        with contextlib.suppress(OSError):
            if p.stat().st_mtime < cutoff:
                p.unlink()


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def extravars_yaml(extravars: Mapping[str, Any]) -> str:
    """The extravars file's text: YAML in which every string (keys too) is tagged `!unsafe`, so ansible-core never
    evaluates Jinja in it (JSON cannot carry the tag). The data is what JSON makes of it (tuples as lists, keys as
    strings), as when this file was JSON. An empty string stays untagged: ansible-core reads an empty `!unsafe ""`
    as null, and it holds nothing to evaluate."""
    import yaml

    class UnsafeDumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):   # type: ignore[misc]
        pass

    def unsafe(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
        return dumper.represent_scalar("!unsafe" if text else "tag:yaml.org,2002:str", text, style='"')

    UnsafeDumper.add_representer(str, unsafe)
    return yaml.dump(json.loads(json.dumps(extravars)), Dumper=UnsafeDumper, width=2**31 - 1, sort_keys=False)


def run_playbook(spec: RunSpec, on_event: Callable[[str, str, str], None] | None = None) -> PlaybookResult:
    """Run one playbook; on_event(host, task, status) is called for each task result."""
    from ansible_runner.interface import init_runner

    failures: list[HostFailure] = []
    changed: dict[str, int] = {}

    def handler(event: dict[str, Any]) -> bool:
        kind = event.get("event", "")
        data = event.get("event_data", {})
        host, task = data.get("host", ""), data.get("task", "")
        status = {"runner_on_ok": "ok", "runner_on_failed": "failed", "runner_on_unreachable": "unreachable",
                  "runner_on_skipped": "skipped", "runner_on_start": "start"}.get(kind)
        if status is None:
            return True
        res = data.get("res") or {}
        if status == "ok" and res.get("changed"):
            status = "changed"
            changed[host] = changed.get(host, 0) + 1
        if status in ("failed", "unreachable") and not data.get("ignore_errors"):
            failures.append(HostFailure(host, task, _failure_message(res)))
        if on_event:
            on_event(host, task, status)
        return True

    pdd = Path(spec.private_data_dir)
    (pdd / "env").mkdir(mode=0o700, parents=True, exist_ok=True)
    for d in (pdd.parent, pdd, pdd / "env"):
        d.chmod(0o700)
    envvars = dict(spec.envvars)
    # Use the ansible-playbook that belongs to this interpreter (a venv's bin is often not on PATH).
    bindir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if (Path(bindir) / "ansible-playbook").exists() and bindir not in path.split(":"):
        envvars["PATH"] = f"{bindir}:{path}"
    if spec.envvars.get("ANSIBLE_SSH_CONTROL_PATH_DIR"):
        make_private_dir(Path(spec.envvars["ANSIBLE_SSH_CONTROL_PATH_DIR"]))
    # runner passes env/extravars as `-e @file`; given extravars itself it would put them on the command line
    _remove_stale_extravars(pdd.parents[2])
    extravars = pdd / "env" / "extravars"
    _write_private(extravars, extravars_yaml(spec.extravars))
    try:
        runner = init_runner(
            private_data_dir=spec.private_data_dir, playbook=spec.playbook, inventory=spec.inventory,
            ident=spec.ident, limit=spec.limit, forks=spec.forks, envvars=envvars, cmdline=spec.cmdline,
            event_handler=handler, quiet=True, suppress_env_files=True,
        )
        runner.config.env = runner_env(runner.config.env, envvars, os.environ)
        runner.run()
    finally:
        extravars.unlink(missing_ok=True)
    if runner.status != "successful" and not failures:
        out = ""
        with contextlib.suppress(OSError, AttributeError):
            out = runner.stdout.read()
        failures.append(HostFailure("", "ansible-playbook", out.strip()[-1500:] or f"status {runner.status}"))
    return PlaybookResult(status=runner.status, rc=runner.rc if runner.rc is not None else 1, failures=failures,
                          changed=changed, artifacts=os.path.join(spec.private_data_dir, "artifacts", spec.ident))


def close_control_masters(run_dir: Path) -> None:
    """ControlPersist masters outlive ansible-playbook; end the ones this run opened (and remove their directory
    when it is not the run directory's own)."""
    cp = control_socket_dir(run_dir / "cp")
    if not _private(cp):
        return
    for sock in cp.iterdir():
        subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "kimictl-control-master"],
                       capture_output=True, timeout=10, check=False)
    if cp != run_dir / "cp":
        shutil.rmtree(cp, ignore_errors=True)
