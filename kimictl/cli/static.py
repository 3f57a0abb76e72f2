"""Static commands (no host touched): topologies, validate, plan, render, schema."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from kimictl.cli.common import (
    HostKeysOpt,
    InventoryOpt,
    Output,
    OutputOpt,
    TopologyOpt,
    emit_json,
    handle_errors,
    out_dir,
    writing_out,
)
from kimictl.errors import EXIT_DEGRADED


@handle_errors
def topologies(output: OutputOpt = Output.text) -> None:
    """List topology presets with a one-line description."""
    from kimictl.topology import load_topology, preset_names

    topos = [load_topology(n) for n in preset_names()]
    if output == Output.json:
        emit_json({"topologies": [{"name": t.name, "description": t.description, "hardware": t.hardware,
                                   "mode": t.mode, "roles": {r: {"dp": s.dp, "tp": s.tp, "nodes": s.nodes}
                                                             for r, s in t.roles.items()}} for t in topos]})
        return
    from kimictl.cli.views import print_to_stdout, topologies_view

    print_to_stdout(topologies_view(topos))


@handle_errors
def validate(
    inventory: InventoryOpt,
    topology: TopologyOpt,
    output: OutputOpt = Output.text,
    live: Annotated[bool, typer.Option("--live", help="Also run preflight over SSH on every host.")] = False,
    accept_new_host_keys: HostKeysOpt = False,
) -> None:
    """Check the inventory schema, the topology and that the plan is feasible (exit 2 when not)."""
    from kimictl.pipeline import prepare

    p = prepare(inventory, topology)
    summary = {
        "valid": True, "cluster": p.plan.cluster, "topology": p.plan.topology, "hosts": len(p.inventory.hosts),
        "engines": len(p.plan.engines), "warnings": p.plan.warnings,
    }
    if live:
        from kimictl.cli.preflight import run_and_print

        if output == Output.text:
            typer.echo(f"ok: static checks passed ({summary['hosts']} host(s), {summary['engines']} engine(s))")
        run_and_print(inventory, topology, output, accept_new_host_keys, None, 30.0,
                      extra={"validate": summary} if output == Output.json else None)
        return
    if output == Output.json:
        emit_json(summary)
        return
    typer.echo(f"ok: {inventory} with topology {p.plan.topology}: {summary['hosts']} host(s), "
               f"{summary['engines']} engine(s), plan feasible")
    for w in p.plan.warnings:
        typer.echo(f"warning: {w}")


@handle_errors
def plan(
    inventory: InventoryOpt,
    topology: TopologyOpt,
    output: OutputOpt = Output.text,
    detailed_exitcode: Annotated[bool, typer.Option("--detailed-exitcode",
                                                    help="Exit 3 when the plan differs from the deploy (the "
                                                         "cluster's release record, read back over SSH).")] = False,
) -> None:
    """Show host->role assignment, DP x TP x EP, per-NPU HBM and KV capacity (estimates), ports, switches,
    and which hosts would change against the last recorded deploy."""
    from kimictl.pipeline import prepare
    from kimictl.render import render as do_render
    from kimictl.state import deployed_diff

    p = prepare(inventory, topology)
    if detailed_exitcode:   # a drift check (CI): against what the cluster records, not only this control node
        from kimictl.cluster_record import sync

        sync(p.inventory)
    diff = deployed_diff(p.plan.cluster, do_render(p.plan, p.inventory, p.topology).releases)
    if output == Output.json:
        emit_json({"schema_version": 1, **p.plan.model_dump(mode="json"), "deployed": diff})
    else:
        from kimictl.cli.views import plan_view, print_to_stdout

        print_to_stdout(plan_view(p.plan))
        if diff["release"] is None:
            typer.echo(f"deployed: nothing recorded for cluster {p.plan.cluster}; deploy would start everything")
        elif diff["changed_hosts"]:
            typer.echo(f"deployed: release {diff['release']}; this plan changes {', '.join(diff['changed_hosts'])}")
        else:
            typer.echo(f"deployed: release {diff['release']}; no changes")
    if detailed_exitcode and (diff["release"] is None or diff["changed_hosts"]):
        raise typer.Exit(EXIT_DEGRADED)


@handle_errors
def render(
    inventory: InventoryOpt,
    topology: TopologyOpt,
    out_arg: Annotated[str | None, typer.Option("--out", help="Write per-host files and render.json here.")] = None,
    output: OutputOpt = Output.text,
) -> None:
    """Render per-host launch artifacts: engine env + launch scripts, container specs, proxy command."""
    from kimictl.pipeline import prepare
    from kimictl.render import render as do_render
    from kimictl.render import write_rendered

    out = out_dir(out_arg)
    p = prepare(inventory, topology)
    rendered = do_render(p.plan, p.inventory, p.topology)
    if out is not None:
        with writing_out(out):
            write_rendered(rendered, out)
    if output == Output.json:
        emit_json(rendered.contract())
        return
    from kimictl.cli.views import print_to_stdout, render_view

    print_to_stdout(render_view(rendered, str(out) if out else None))


class SchemaKind(str, Enum):
    inventory = "inventory"
    topology = "topology"


@handle_errors
def schema(kind: Annotated[SchemaKind, typer.Argument(help="inventory or topology")]) -> None:
    """Print the JSON Schema of inventory variables or of a topology file."""
    if kind == SchemaKind.topology:
        from kimictl.topology import Topology

        emit_json(Topology.model_json_schema())
        return
    from kimictl.inventory import KEYS, ClusterSettings, Host

    emit_json({
        "description": "kimictl inventory variables (an Ansible YAML inventory; cluster keys under all.vars)",
        "cluster_vars": ClusterSettings.model_json_schema(),
        "host_vars": Host.model_json_schema(),
        "keys": {k: {"scope": v.scope, "help": v.help} for k, v in KEYS.items()},
    })
