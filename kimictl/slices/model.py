"""Slices: one DP group each, the unit that restarts together, and the HTTP endpoints its engines serve.

Pure: a render in, slices out; no hosts."""

from __future__ import annotations

from dataclasses import dataclass

from kimictl.render import Rendered


@dataclass(frozen=True)
class Endpoint:
    engine: str
    host: str
    ip: str
    port: int
    role: str

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


@dataclass(frozen=True)
class Slice:
    """One DP group (instance): the unit that restarts together (its ranks share a DP master and a kv_port)."""

    name: str
    role: str
    hosts: tuple[str, ...]
    engines: tuple[str, ...]
    endpoints: tuple[Endpoint, ...]


def slices_of(rendered: Rendered) -> dict[str, Slice]:
    """Every instance of the plan as a slice, in plan order."""
    out: dict[str, Slice] = {}
    for inst in rendered.plan.instances:
        engines = [e for e in rendered.engines if e.instance == inst.name]
        out[inst.name] = Slice(inst.name, inst.role, tuple(inst.hosts), tuple(e.id for e in engines),
                               tuple(Endpoint(e.id, e.host, e.host_ip, e.port, e.role)
                                     for e in engines if e.serves_http))
    return out
