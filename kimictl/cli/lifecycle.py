"""`kimictl stop` / `kimictl start`: every supervised process off, or the current release back up."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from kimictl.cli.common import InventoryOpt, Output, OutputOpt, emit_json, handle_errors, stderr_console

LimitOpt = Annotated[list[str] | None, typer.Option("--limit", help="Only these hosts (repeatable).")]
HostKeysOpt = Annotated[bool, typer.Option("--accept-new-host-keys")]


def _reporters(verb: str):
    err = stderr_console()

    def say(msg: str) -> None:
        err.print(f"[cyan]{verb}[/] {msg}", highlight=False)

    def on_event(host: str, task: str, status: str) -> None:
        if status in ("changed", "failed", "unreachable"):
            style = {"changed": "yellow", "failed": "bold red", "unreachable": "bold red"}[status]
            err.print(f"  [{style}]{status:>11}[/] {host}: {task}", highlight=False)

    return say, on_event


@handle_errors
def stop(
    inventory: InventoryOpt,
    limit: LimitOpt = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    accept_new_host_keys: HostKeysOpt = False,
    output: OutputOpt = Output.text,
) -> None:
    """Stop engines and the proxy (proxy, then decode, then prefill); weights, releases and `current` stay."""
    from kimictl import lifecycle
    from kimictl.inventory import load_inventory

    inv = load_inventory(inventory).limited(limit)
    if not yes and sys.stdin.isatty() and sys.stderr.isatty():
        typer.confirm(f"Stop every engine and the proxy on {len(inv.hosts)} host(s) of {inv.cluster.name}?",
                      abort=True, err=True)
    say, on_event = _reporters("stop")
    res = lifecycle.stop(inv, say=say, on_event=on_event, accept_new_host_keys=accept_new_host_keys)
    if output == Output.json:
        emit_json(res.to_json())
        return
    n = sum(len(h["stopped"]) for h in res.hosts.values())
    typer.echo(f"stopped {n} process(es)" if n else "already stopped: nothing runs")
    for h, info in res.hosts.items():
        typer.echo(f"  {h}: stopped {', '.join(info['stopped']) or '-'}; current {info['current'] or '-'} kept")


@handle_errors
def start(
    inventory: InventoryOpt,
    limit: LimitOpt = None,
    ready_timeout: Annotated[float | None, typer.Option("--ready-timeout",
                                                        help="Seconds to wait for engines to load.")] = None,
    accept_new_host_keys: HostKeysOpt = False,
    output: OutputOpt = Output.text,
) -> None:
    """Start each host's current release: engines, wait until they answer, then the proxy."""
    from kimictl import lifecycle
    from kimictl.inventory import load_inventory

    inv = load_inventory(inventory).limited(limit)
    say, on_event = _reporters("start")
    res = lifecycle.start(inv, say=say, on_event=on_event, ready_timeout=ready_timeout,
                          accept_new_host_keys=accept_new_host_keys)
    if output == Output.json:
        emit_json(res.to_json())
        return
    n = sum(len(h["started"]) for h in res.hosts.values())
    typer.echo(f"started {n} process(es); all answer" if n else "already running: every process answers")
    for h, info in res.hosts.items():
        typer.echo(f"  {h}: release {info['release']}: started {', '.join(info['started']) or '-'}, "
                   f"kept {', '.join(info['kept']) or '-'}")
