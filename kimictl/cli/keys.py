"""`kimictl keys rotate`: a new admin key for the cluster's proxy front, installed and checked."""

from __future__ import annotations

from typing import Annotated

import typer

from kimictl.cli import common
from kimictl.cli.common import HostKeysOpt, InventoryOpt, Output, OutputOpt, WaitOpt, YesOpt

app = typer.Typer(help="The cluster's own keys (they live on the cluster; this control node keeps a copy).",
                  no_args_is_help=True, rich_markup_mode=None)


@app.command()
@common.handle_errors
def rotate(
    inventory: InventoryOpt,
    admin: Annotated[bool, typer.Option("--admin", help="Rotate the proxy admin key (the routers' own API: drain, "
                                                         "re-add); the default, and the only key rotated here.")]
    = False,
    yes: YesOpt = False,
    wait: WaitOpt = 0.0,
    accept_new_host_keys: HostKeysOpt = False,
    output: OutputOpt = Output.text,
) -> None:
    """Make a new proxy admin key, install it on the proxy host (nothing restarts) and check the front takes it."""
    from kimictl.deployed import current_deployment
    from kimictl.keys_rotate import check_not_supplied, check_rotatable, rotate_admin_key

    inv = common.cluster_inventory(inventory)
    check_not_supplied(inv)   # before the record is read from the hosts
    rendered = current_deployment(inv.cluster.name, inv, accept_new_keys=accept_new_host_keys).rendered
    check_rotatable(inv, rendered)
    assert rendered.plan.proxy is not None
    common.confirm_or_yes(f"Rotate the proxy admin key of {inv.cluster.name} (proxy host "
                          f"{rendered.plan.proxy.host})?", yes)
    say, on_event = common.reporters("keys")
    with common.cluster_lease(inv, "keys rotate", wait, accept_new_host_keys):
        result = rotate_admin_key(inv, rendered, say, on_event=on_event, accept_new_host_keys=accept_new_host_keys)
    if output == Output.json:
        common.emit_json(result.to_json())
        return
    typer.echo(f"rotated the proxy admin key of {result.cluster}: the front on {result.proxy_host} answers "
               f"{result.check} with the new key")
    typer.echo(f"run directory: {result.run_dir}")
