"""A cluster's own keys read back from its hosts: a control node without its copy (a CI runner with an empty state
dir) takes the key the cluster holds instead of making another. Read-only, one SSH round trip per host (paramiko,
kimictl/ssh.py), the root-only files release.yml installs: `<kimi_state_dir>/secrets/proxy-admin-key` (the key as
it is) and `<kimi_state_dir>/secrets/engine-api-key.env` (`VLLM_API_KEY=<key>`). What a host answers is data: each
file is checked as a key (kimictl/secret_file.py `key_problem`) before it is used, and hosts that hold different
keys are refused. Which key a command uses: kimictl/cluster_secrets.py."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from kimictl.errors import HostError, reported
from kimictl.inventory import Inventory
from kimictl.secret_file import MAX_SECRET, key_problem
from kimictl.ssh import Sessions, SSHError

MARK = "@@kimictl-key "
ENV_LINE = re.compile(r"VLLM_API_KEY=(.*)")


@dataclass
class Held:
    """What the asked hosts answered: the key each holds, the hosts without one, the hosts that did not answer."""

    keys: dict[str, str] = field(default_factory=dict)
    absent: list[str] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)


def read_command(path: str) -> str:
    """One shell line: a mark saying whether `path` is a regular file, then at most MAX_SECRET + 1 of its bytes."""
    f = shlex.quote(path)
    return (f"if [ -f {f} ]; then echo '{MARK}present'; head -c {MAX_SECRET + 1} -- {f}; "
            f"elif [ -e {f} ]; then echo '{MARK}other'; else echo '{MARK}absent'; fi")


def parse_answer(host: str, path: str, out: str, what: str, env_line: bool) -> str | None:
    """The key in a host's answer to read_command, None when the host holds none; HostError (step keys) naming
    the host and the file when the answer is not one valid key."""
    head, _, body = out.partition("\n")
    state = head.removeprefix(MARK) if head.startswith(MARK) else None
    if state == "absent":
        return None
    if state == "other":
        raise HostError(f"{what} {path} is not a regular file", host=host, step="keys")
    if state != "present":
        # not quoted: what came instead of the mark may be the key itself
        raise HostError(f"reading {what} {path} answered {len(out)} characters without kimictl's mark", host=host,
                        step="keys")
    text = body.strip()
    if env_line:
        m = ENV_LINE.fullmatch(text)
        if not m:
            raise HostError(f"{what} {path} is not one line VLLM_API_KEY=<key>", host=host, step="keys",
                            hint="release.yml writes it; `kimictl deploy` installs it again")
        text = m.group(1)
    why = key_problem(text)
    if why:
        raise HostError(f"{what} {path} holds no valid key: {why}", host=host, step="keys",
                        hint="release.yml writes it; `kimictl deploy` installs it again")
    return text


def read_back(inv: Inventory, hosts: list[str], rel: str, what: str, env_line: bool, *,
              timeout: float = 10.0) -> Held:
    """The key file `<kimi_state_dir>/<rel>` of each of `hosts` (inventory names), read in parallel."""
    held = Held()

    def one(name: str, s) -> str | None:
        path = f"{inv.host(name).kimi_state_dir}/{rel}"
        res = s.run(read_command(path), timeout=timeout)
        if res.rc != 0:
            raise HostError(f"cannot read {what} {path}: {reported(res.stderr.strip(), 200)}", host=name,
                            step="keys", hint="kimictl reads the cluster's keys as the inventory's SSH user (root)")
        return parse_answer(name, path, res.stdout, what, env_line)

    with Sessions(inv.limited(hosts), timeout=timeout) as sessions:
        got = sessions.each(one)
    for name in hosts:
        r = got.get(name)
        if isinstance(r, SSHError):
            held.unreachable[name] = str(r)
        elif r is None:
            held.absent.append(name)
        else:
            held.keys[name] = r
    return held


def agreed(held: Held, what: str, hint: str) -> str | None:
    """The one key the hosts hold (None: none holds one); HostError naming the hosts when they hold different keys
    (the keys themselves are never shown)."""
    groups: dict[str, list[str]] = {}
    for host, key in held.keys.items():
        groups.setdefault(key, []).append(host)
    if len(groups) > 1:
        sets = list(groups.values())
        raise HostError(f"{what}: the hosts hold {len(sets)} different keys: " + " / ".join(", ".join(s) for s in sets),
                        host=sets[0][0], step="keys",
                        details=[f"key {i + 1}: {', '.join(s)}" for i, s in enumerate(sets)], hint=hint)
    return next(iter(groups), None)
