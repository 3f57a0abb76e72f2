"""A stand-in for kimictl.ssh.Sessions in unit tests: every host's session answers each command with
`answer(host, command)` as its stdout (exit code 0); an SSHError fn raises becomes that host's result, as in
Sessions.each."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from kimictl.ssh import SSHError


def fake_sessions(answer: Callable[[str, str], str]) -> type:
    class Session:
        def __init__(self, host: str):
            self.host = host

        def run(self, cmd: str, timeout: float | None = None, stdin: Any = None) -> SimpleNamespace:
            return SimpleNamespace(rc=0, stdout=answer(self.host, cmd), stderr="")

    class Sessions:
        def __init__(self, inv: Any, **_kw: Any):
            self.inv = inv

        def __enter__(self) -> Sessions:
            return self

        def __exit__(self, *exc: Any) -> bool:
            return False

        def each(self, fn: Callable[[str, Session], Any]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for h in self.inv.hosts:
                try:
                    out[h.name] = fn(h.name, Session(h.name))
                except SSHError as exc:
                    out[h.name] = exc
            return out

    return Sessions


def held_keys(files: dict[str, dict[str, str]], down: tuple[str, ...] = (), asked: list | None = None) -> type:
    """fake_sessions for kimictl.key_readback: `files` says what each host holds under <kimi_state_dir>/secrets/
    (file name -> content), hosts in `down` cannot be reached; `asked` collects (host, file) of every read."""
    from kimictl.key_readback import MARK

    def answer(host: str, cmd: str) -> str:
        name = "engine-api-key.env" if "/secrets/engine-api-key.env " in cmd else "proxy-admin-key"
        if asked is not None:
            asked.append((host, name))
        if host in down:
            raise SSHError(f"cannot reach {host}: Connection refused")
        text = files.get(host, {}).get(name)
        return f"{MARK}absent\n" if text is None else f"{MARK}present\n{text}"

    return fake_sessions(answer)
