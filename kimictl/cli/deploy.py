"""`kimictl deploy`: converge hosts to the plan (preflight, release, engines, proxy, smoke, switch)."""

from __future__ import annotations

from typing import Annotated

import typer

from kimictl.cli import common
from kimictl.cli.common import (
    HostKeysOpt,
    InventoryOpt,
    LimitOpt,
    Output,
    OutputOpt,
    ReadyTimeoutOpt,
    SkipPreflightOpt,
    TokenFileOpt,
    TopologyOpt,
    WaitOpt,
    YesOpt,
)


@common.handle_errors
def deploy(
    inventory: InventoryOpt,
    topology: TopologyOpt,
    yes: YesOpt = False,
    check: Annotated[bool, typer.Option("--check", help="Show what would change; change nothing.")] = False,
    diff: Annotated[bool, typer.Option("--diff", help="With --check: show file diffs of changed engines.")] = False,
    limit: LimitOpt = None,
    skip_preflight: SkipPreflightOpt = None,
    skip_weights: Annotated[bool, typer.Option("--skip-weights", help="Do not stage weights.")] = False,
    token_file: TokenFileOpt = None,
    ready_timeout: ReadyTimeoutOpt = None,
    wait: WaitOpt = 0.0,
    accept_new_host_keys: HostKeysOpt = False,
    output: OutputOpt = Output.text,
) -> None:
    """Converge the hosts to the plan and start prefill/decode engines and the P/D proxy."""
    from kimictl.cluster_secrets import check_supplied_keys
    from kimictl.deploy import Deployer, DeployOptions, change_diffs, smoke_text
    from kimictl.pipeline import prepare
    from kimictl.render import render
    from kimictl.weights.stage import read_token

    err = common.stderr_console()
    p = prepare(inventory, topology)
    check_supplied_keys(p.inventory)
    p.inventory.limited(limit)  # unknown --limit hosts: exit 2 before anything runs
    rendered = render(p.plan, p.inventory, p.topology)
    if skip_preflight is not None:
        err.print(f"[yellow]preflight skipped: {skip_preflight}[/]")
    token = None if skip_weights else read_token(p.inventory.cluster.kimi_model_source, token_file)
    if not check:
        common.confirm_or_yes(f"Deploy {p.plan.topology} to {len(p.inventory.hosts)} host(s) of {p.plan.cluster}?", yes)
    say, on_event = common.reporters("deploy")
    opts = DeployOptions(check=check, skip_preflight=skip_preflight, limit=limit, ready_timeout=ready_timeout,
                         accept_new_host_keys=accept_new_host_keys, skip_weights=skip_weights, hub_token=token)
    with common.cluster_lease(p.inventory, "deploy", wait, accept_new_host_keys, check=check):
        if not check:   # the cluster's release record first: a release adopted here keeps its whole history
            from kimictl.cluster_record import sync

            sync(p.inventory, accept_new_keys=accept_new_host_keys)
        result = Deployer(p.inventory, p.plan, rendered, opts, say, on_event).run()
    diffs = change_diffs(p.inventory, rendered, result.changes) if check and diff else {}
    if output == Output.json:
        common.emit_json({**result.to_json(), "diffs": diffs})
        return
    todo = [c for c in result.changes if c.action != "keep"]
    if result.result == "check":
        typer.echo(f"check: {len(todo)} change(s) for release {result.release}" if todo else "check: no changes")
        for c in todo:
            typer.echo(f"  {c.action:<8} {c.host}: {c.id}")
        for text in diffs.values():
            typer.echo(text)
    elif result.result == "no-changes":
        typer.echo(f"no changes: release {result.release} is running on every host")
    else:
        typer.echo(f"deployed release {result.release}: {len(todo)} change(s); smoke: {smoke_text(result.smoke)}")
        typer.echo(f"run directory: {result.run_dir}")


def _release_prefix(value: str | None) -> str | None:
    """--to: an empty prefix would match every release (and pick the newest): refused while the flags are read."""
    if value is not None and not value.strip():
        raise typer.BadParameter("give a release id or a prefix of one (deploy and `kimictl status` print them)")
    return value


@common.handle_errors
def rollback(
    inventory: InventoryOpt,
    to: Annotated[str | None, typer.Option("--to", callback=_release_prefix, help="Release id (prefix) to return "
                                                                                  "to; default the previous deployed "
                                                                                  "release.")] = None,
    yes: YesOpt = False,
    skip_preflight: SkipPreflightOpt = None,
    ready_timeout: ReadyTimeoutOpt = None,
    wait: WaitOpt = 0.0,
    accept_new_host_keys: HostKeysOpt = False,
    output: OutputOpt = Output.text,
) -> None:
    """Return the whole cluster to the previous release (or --to RELEASE), with the deploy's gates."""
    from kimictl.deploy import Deployer, DeployOptions, rollback_target

    inv = common.cluster_inventory(inventory)
    target, rendered = rollback_target(inv.cluster.name, to, inv, accept_new_keys=accept_new_host_keys)
    if skip_preflight is not None:
        common.stderr_console().print(f"[yellow]preflight skipped: {skip_preflight}[/]")
    common.confirm_or_yes(f"Roll {inv.cluster.name} back to release {target.release} ({target.at})?", yes)
    say, on_event = common.reporters("rollback")
    opts = DeployOptions(skip_preflight=skip_preflight, ready_timeout=ready_timeout,
                         accept_new_host_keys=accept_new_host_keys)
    with common.cluster_lease(inv, "rollback", wait, accept_new_host_keys):
        result = Deployer(inv, rendered.plan, rendered, opts, say, on_event).run()
    if output == Output.json:
        common.emit_json(result.to_json())
    else:
        typer.echo(f"rolled back to release {result.release} ({result.result})")
