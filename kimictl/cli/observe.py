"""`kimictl observe render|up`: monitoring rendered from the plan, and run on the cluster (or merged into a site's
Prometheus)."""

from __future__ import annotations

from typing import Annotated

import typer

from kimictl.cli.common import (
    HostKeysOpt,
    InventoryOpt,
    Output,
    OutputOpt,
    TopologyOpt,
    WaitOpt,
    cluster_lease,
    emit_json,
    finite_positive,
    handle_errors,
    out_dir,
    reporters,
    writing_out,
)
from kimictl.errors import EXIT_DEGRADED

app = typer.Typer(help="Monitoring from the plan: Prometheus targets, rules and dashboards; Prometheus on the "
                       "cluster.", no_args_is_help=True, rich_markup_mode=None)

ProfileOpt = Annotated[str, typer.Option("--profile", help="Intervals and alert durations from "
                                                           "kimictl/data/observe.yml: default, or sandbox (seconds).")]
PrefixOpt = Annotated[str | None, typer.Option(
    "--prefix", help="Where the targets/ and rules/ directories go on an existing Prometheus host (merge.yml); "
                     "default /etc/prometheus/kimictl/<cluster>.")]


@app.command("render")
@handle_errors
def render_cmd(
    inventory: InventoryOpt,
    topology: TopologyOpt,
    out_arg: Annotated[str, typer.Option("--out", help="Directory to write prometheus.yml, merge.yml, targets/, "
                                                       "rules/ and dashboards/ to.")],
    profile: ProfileOpt = "default",
    prefix: PrefixOpt = None,
    output: OutputOpt = Output.text,
) -> None:
    """Render Prometheus scrape targets (file_sd), recording and alert rules and Grafana dashboards from the plan."""
    from kimictl.observe import render_observe, write_observe
    from kimictl.pipeline import prepare

    out = out_dir(out_arg)
    assert out is not None
    p = prepare(inventory, topology)
    r = render_observe(p.plan, p.inventory, p.topology, profile, prefix)
    with writing_out(out):
        write_observe(r, out)
    if output == Output.json:
        emit_json({**r.summary(), "out": str(out)})
        return
    jobs = ", ".join(f"{j} {len(g)}" for j, g in r.targets.items())
    typer.echo(f"wrote {len(r.files)} files to {out}: {r.target_total} targets ({jobs}), {len(r.records)} "
               f"recording and {len(r.alerts)} alert rules, {sum(1 for f in r.files if f.startswith('dashboards/'))} "
               "dashboards")
    typer.echo(f"Prometheus for this plan runs on {r.monitor_host} ({r.prometheus_url}) with `kimictl observe up`; "
               f"to merge into an existing Prometheus: {out / 'merge.yml'}")


@app.command("up")
@handle_errors
def up_cmd(
    inventory: InventoryOpt,
    topology: Annotated[str | None, typer.Option(
        "--topology", "-t", help="Preset or topology file; default the topology of the current release.")] = None,
    profile: ProfileOpt = "default",
    print_only: Annotated[bool, typer.Option(
        "--print", help="Change nothing: print the scrape configs and rule files to merge into an existing "
                        "Prometheus (write the files with `observe render --out DIR`).")] = False,
    prefix: PrefixOpt = None,
    ready_timeout: Annotated[float, typer.Option(
        "--scrape-timeout", callback=finite_positive,
        help="Seconds to wait for Prometheus to scrape every target once.")] = 120.0,
    wait: WaitOpt = 0.0,
    accept_new_host_keys: HostKeysOpt = False,
    output: OutputOpt = Output.text,
) -> None:
    """Run Prometheus on the monitoring host (kimi_monitor_host, default the proxy host) and node_exporter on every
    host through Ansible, and wait until Prometheus has scraped every rendered target; exit 3 when one is down."""
    from kimictl.observe import render_observe
    from kimictl.pipeline import prepare

    if topology is None:
        from kimictl.deployed import current_deployment
        from kimictl.errors import InvalidInput
        from kimictl.inventory import load_inventory

        inv = load_inventory(inventory)
        cluster = inv.cluster.name
        try:
            deployed = current_deployment(cluster, inv, accept_new_host_keys)
        except InvalidInput:
            raise InvalidInput(f"no deployed release of cluster {cluster} is recorded here to take the topology "
                               "from", hint="pass --topology T (the topology you deploy)") from None
        topology = deployed.topology()
    p = prepare(inventory, topology)
    r = render_observe(p.plan, p.inventory, p.topology, profile, prefix)
    if print_only:
        if output == Output.json:
            emit_json({**r.summary(), "merge": r.files["merge.yml"]})
        else:
            typer.echo(r.files["merge.yml"], nl=False)
        return
    from kimictl.observe_up import observe_up

    say, on_event = reporters("observe")
    with cluster_lease(p.inventory, "observe up", wait, accept_new_host_keys):
        res = observe_up(p.plan, p.inventory, r, say=say, on_event=on_event, ready_timeout=ready_timeout,
                         accept_new_host_keys=accept_new_host_keys)
    if output == Output.json:
        emit_json(res.to_json())
    else:
        typer.echo(f"Prometheus: {res.prometheus_url} (on {res.monitor_host}); {len(res.up)}/{res.targets} targets up")
        for t in res.down:
            typer.echo(f"  down: {t['job']} {t['instance'] or ''} ({t['host'] or '?'}): {t['error']}")
        typer.echo(f"dashboards and rules: {res.files}")
    if res.down:
        raise typer.Exit(EXIT_DEGRADED)
