"""`kimictl rollout`: change a running P/D deployment slice by slice (canary, drain, restart, gates, rollback)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kimictl.cli import common
from kimictl.cli.common import HostKeysOpt, InventoryOpt, Output, OutputOpt, ReadyTimeoutOpt, WaitOpt, YesOpt


@common.handle_errors
def rollout(
    inventory: InventoryOpt,
    topology: Annotated[str | None, typer.Option(
        "--topology", "-t", help="Preset or topology file; default the topology of the current release (with the "
                                 "--set values of earlier rollouts).")] = None,
    sets: Annotated[list[str] | None, typer.Option(
        "--set", metavar="KEY=VALUE", help="Change one plan input (repeatable): decode.serve.max-num-seqs=32, "
                                           "prefill.env.NAME=1, serve.seed=7, kimi_vllm_ascend_version=0.23.0; "
                                           "VALUE is YAML, null removes a key.")] = None,
    canary: Annotated[int, typer.Option("--canary", min=0, help="Slices rolled (and gated) first.")] = 1,
    serial: Annotated[int, typer.Option("--serial", min=1, help="Slices per batch after the canary.")] = 1,
    check: Annotated[bool, typer.Option("--check", help="Show slices, order and gates; change nothing.")] = False,
    yes: YesOpt = False,
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", min=1.0, help="Seconds to let a drained "
                                                 "slice's in-flight requests finish.")] = 300.0,
    drain_quiet: Annotated[float, typer.Option("--drain-quiet", min=0.0, help="Seconds a drained slice must stay "
                                               "idle before it stops (covers requests still in their prefill "
                                               "elsewhere).")] = 5.0,
    allow_proxy_restart: Annotated[bool, typer.Option(
        "--allow-proxy-restart", help="Allow restarting the proxy process itself: a change to its own command "
                                      "(policy, membership), or a proxy deployed before kimictl's front that must "
                                      "restart to re-add slices; clients see refused connections meanwhile.")
    ] = False,
    router: Annotated[list[str] | None, typer.Option(
        "--router", metavar="URL", help="Another router in front of the same engines (repeatable); it must add "
                                        "workers at runtime (vllm-router --enable-igw).")] = None,
    ready_timeout: ReadyTimeoutOpt = None,
    wait: WaitOpt = 0.0,
    accept_new_host_keys: HostKeysOpt = False,
    output: OutputOpt = Output.text,
) -> None:
    """Roll a change out slice by slice: canary first, each slice drained, restarted, gated, re-added."""
    from kimictl.rollout.run import Rollout, RolloutOptions, prepare_rollout
    from kimictl.routers import check_router_url

    for url in router or []:
        check_router_url(url)
    inputs = prepare_rollout(Path(inventory), topology, sets or [], read_cluster=True,
                             accept_new_keys=accept_new_host_keys)
    opts = RolloutOptions(canary=canary, serial=serial, check=check, drain_timeout=drain_timeout,
                          drain_quiet=drain_quiet, ready_timeout=ready_timeout,
                          allow_proxy_restart=allow_proxy_restart, routers=router or [],
                          accept_new_host_keys=accept_new_host_keys)

    say, on_event = common.reporters("rollout", events=("failed", "unreachable"))
    ro = Rollout(inputs, opts, say, on_event)
    ro.check_inputs()   # a change that cannot be rolled out is refused before the lease and the hosts
    if not check:
        common.confirm_or_yes(f"Roll {', '.join(s.raw for s in inputs.sets) or inputs.topology.name} out to "
                              f"{inputs.inventory.cluster.name} (release {inputs.record.release} -> {ro.release})?",
                              yes)
    with common.cluster_lease(inputs.inventory, "rollout", wait, accept_new_host_keys, check=check):
        result = ro.run()
    if output == Output.json:
        common.emit_json(result.to_json())
        return
    if result.result == "no-changes":
        typer.echo(f"no changes: release {result.previous_release} already runs on every slice")
        return
    verb = "would roll out" if result.result == "check" else "rolled out"
    typer.echo(f"{verb} release {result.release} (from {result.previous_release}); proxy membership: "
               + ", ".join(f"{u} {m}" for u, m in result.membership.items()))
    for i, names in enumerate(result.batches):
        reps = [s for s in result.slices if s.name in names]
        canary_mark = " (canary)" if reps and reps[0].canary else ""
        line = f"  batch {i + 1}{canary_mark}: {', '.join(names)}"
        if result.result != "check":
            line += " - " + ", ".join(f"{s.name} {s.result} in {s.seconds.get('total', 0):.1f}s" for s in reps)
        typer.echo(line)
    for n in result.notes:
        typer.echo(f"  note: {n}")
    if result.proxy_restarts:
        typer.echo(f"  re-adds and proxy restarts: {len(result.proxy_restarts)} ("
                   + ", ".join(f"{r['kind']} {r['seconds']:.1f}s" for r in result.proxy_restarts) + ")")
    if result.run_dir:
        typer.echo(f"run directory: {result.run_dir}")

