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
