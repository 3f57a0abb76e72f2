"""`kimictl stop` / `kimictl start`: every supervised process off, or the current release back up."""

from __future__ import annotations

import typer

from kimictl.cli import common
from kimictl.cli.common import HostKeysOpt, InventoryOpt, LimitOpt, Output, OutputOpt, ReadyTimeoutOpt, YesOpt


@common.handle_errors
def stop(
    inventory: InventoryOpt,
    limit: LimitOpt = None,
    yes: YesOpt = False,
    wait: common.WaitOpt = 0.0,
    accept_new_host_keys: HostKeysOpt = False,
    output: OutputOpt = Output.text,
) -> None:
    """Stop engines and the proxy (proxy, then decode, then prefill); weights, releases and `current` stay."""
    from kimictl import lifecycle

    whole = common.cluster_inventory(inventory)
    inv = whole.limited(limit)
    common.confirm_or_yes(f"Stop every engine and the proxy on {len(inv.hosts)} host(s) of {inv.cluster.name}?", yes)
    say, on_event = common.reporters("stop")
    with common.cluster_lease(whole, "stop", wait, accept_new_host_keys):
        res = lifecycle.stop(inv, say=say, on_event=on_event, accept_new_host_keys=accept_new_host_keys)
    if output == Output.json:
        common.emit_json(res.to_json())
        return
    n = sum(len(h["stopped"]) for h in res.hosts.values())
    typer.echo(f"stopped {n} process(es)" if n else "already stopped: nothing runs")
    for h, info in res.hosts.items():
        typer.echo(f"  {h}: stopped {', '.join(info['stopped']) or '-'}; current {info['current'] or '-'} kept")


@common.handle_errors
def start(
    inventory: InventoryOpt,
    limit: LimitOpt = None,
    yes: YesOpt = False,
    ready_timeout: ReadyTimeoutOpt = None,
    wait: common.WaitOpt = 0.0,
    accept_new_host_keys: HostKeysOpt = False,
    output: OutputOpt = Output.text,
) -> None:
    """Start each host's current release: engines, wait until they answer, then the proxy."""
    from kimictl import lifecycle

    whole = common.cluster_inventory(inventory)
    inv = whole.limited(limit)
    common.confirm_or_yes(f"Start the current release on {len(inv.hosts)} host(s) of {inv.cluster.name}?", yes)
    say, on_event = common.reporters("start")
    with common.cluster_lease(whole, "start", wait, accept_new_host_keys):
        res = lifecycle.start(inv, say=say, on_event=on_event, ready_timeout=ready_timeout,
                              accept_new_host_keys=accept_new_host_keys)
    if output == Output.json:
        common.emit_json(res.to_json())
        return
    n = sum(len(h["started"]) for h in res.hosts.values())
    typer.echo(f"started {n} process(es); all answer" if n else "already running: every process answers")
    for h, info in res.hosts.items():
        typer.echo(f"  {h}: release {info['release']}: started {', '.join(info['started']) or '-'}, "
                   f"kept {', '.join(info['kept']) or '-'}")
