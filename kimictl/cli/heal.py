"""`kimictl heal`: find dead, hung and mis-paired slices of a P/D deployment and heal them one at a time (drain,
restart, pair smoke, re-add); flap damping escalates with exit 1. Also `status --watch N --heal`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kimictl.cli import common
from kimictl.cli.common import HostKeysOpt, InventoryOpt, Output, OutputOpt, ReadyTimeoutOpt

if TYPE_CHECKING:
    from kimictl.heal import HealGiven, HealResult


def heal_round(inventory: Path, given: HealGiven, say, on_event) -> HealResult:
    """One heal round on the release the cluster runs now (read again every round: a rollout may have moved it)."""
    from kimictl.cluster_record import sync
    from kimictl.heal import Healer, HealOptions, prepare_heal

    sync(common.cluster_inventory(inventory), accept_new_keys=bool(given.get("accept_new_host_keys")))
    inputs = prepare_heal(inventory)
    return Healer(inputs, HealOptions.resolve(inputs.topology_heal, **given), say, on_event).run()


def print_result(res: HealResult) -> None:
    verb = {"healthy": "nothing to heal", "planned": "would heal", "healed": "healed", "failed": "heal failed",
            "escalated": "escalated", "deferred": "deferred (another command holds the cluster lease)",
            "unreachable": "host(s) do not answer"}[res.result]
    typer.echo(f"{res.cluster} (release {res.release}): {verb}")
    for host, why in res.unreachable.items():
        typer.echo(f"  unreachable host {host}: {why}")
    for f in res.findings:
        typer.echo(f"  {f.kind:>10}  {f.slice or '-'}  {f.engine}{' on ' + f.host if f.host else ''}: {f.detail}")
    for a in res.actions:
        line = f"  {a.slice} ({a.role} on {', '.join(a.hosts)}): {' -> '.join(a.steps)} [{a.result}]"
        if a.seconds.get("total") is not None:
            line += f" in {a.seconds['total']:.1f}s"
        typer.echo(line)
        if a.note:
            typer.echo(f"    note: {a.note}")
    if res.proxy_gate:
        typer.echo(f"  proxy gate: {res.proxy_gate['requests']} request(s) through the proxy, all answered")
    if res.run_dir:
        typer.echo(f"run directory: {res.run_dir}")
    typer.echo(f"event log: {res.event_log}")


def report_failure(res: HealResult) -> None:
    """Why the round ends with exit 1, on stderr (text and JSON alike)."""
    err = common.stderr_console()
    for e in res.escalations:
        err.print(f"[bold red]escalate[/] {e}", highlight=False)
    if res.error:
        err.print(f"[bold red]error[/] {res.error}", highlight=False, markup=False)


@common.handle_errors
def heal(
    inventory: InventoryOpt,
    once: Annotated[bool, typer.Option("--once", help="One round (detect, heal, report), then exit.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Detect and print the planned actions; change nothing "
                                                            "(exit 3 when there are some).")] = False,
    hang_deadline: Annotated[float | None, typer.Option(
        "--hang-deadline", min=0.1, help="Seconds an engine may run requests without any progress (token counters "
                                         "flat) before it counts as hung (default: the topology's "
                                         "heal.hang_deadline_s, else kimictl/data/heal.yml)."
    )] = None,
    max_actions: Annotated[int | None, typer.Option(
        "--max-actions", min=1, help="Actions per slice within --window before heal escalates (exit 1).")] = None,
    window: Annotated[float | None, typer.Option("--window", min=1.0, help="The flap-damping window, seconds.")] = None,
    interval: Annotated[float | None, typer.Option(
        "--interval", min=1.0, help="Seconds between rounds without --once (default: heal.yml's interval_s).")] = None,
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", min=1.0, help="Seconds a drained slice may take "
                                                 "to finish its in-flight requests (requests that make no progress are "
                                                 "not waited for).")] = 300.0,
    ready_timeout: ReadyTimeoutOpt = None,
    accept_new_host_keys: HostKeysOpt = False,
    output: OutputOpt = Output.text,
) -> None:
    """Detect dead, hung and mis-paired engines; drain, restart, pair-smoke and re-add their slices."""
    from kimictl.errors import EXIT_FAILED, KimictlError
    from kimictl.heal import heal_defaults

    given: HealGiven = {"dry_run": dry_run, "hang_deadline": hang_deadline, "max_actions": max_actions,
                        "window": window, "drain_timeout": drain_timeout, "ready_timeout": ready_timeout,
                        "accept_new_host_keys": accept_new_host_keys}
    pause = interval or float(heal_defaults()["interval_s"])
    say, on_event = common.reporters("heal", events=("failed", "unreachable"))
    while True:
        try:
            res = heal_round(Path(inventory), given, say, on_event)
        except KimictlError as exc:   # a host, or a record another control node is rewriting: the next round may do
            if once or dry_run:
                raise
            typer.echo(f"error: {exc.render()} (heal watches on)", err=True)
            time.sleep(pause)
            continue
        if output == Output.json:
            common.emit_json(res.to_json())
        else:
            print_result(res)
        if res.exit_code == EXIT_FAILED:
            report_failure(res)
        if once or dry_run or res.result == "escalated":
            raise typer.Exit(res.exit_code)
        time.sleep(pause)
