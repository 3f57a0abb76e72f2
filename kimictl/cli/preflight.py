"""`kimictl preflight`: live read-only checks on every host against the plan."""

from __future__ import annotations

from typing import Annotated

import typer

from kimictl.cli.common import HostKeysOpt, InventoryOpt, Output, OutputOpt, TopologyOpt, emit_json, handle_errors
from kimictl.errors import EXIT_FAILED

SkipOpt = Annotated[list[str] | None, typer.Option("--skip-check", help="Check id to skip (repeatable).")]
TimeoutOpt = Annotated[float, typer.Option("--timeout", min=1.0, help="Per-host SSH/probe timeout in seconds.")]


def run_and_print(inventory, topology, output: Output, accept_new_host_keys: bool, skip_check, timeout: float,
                  extra: dict | None = None) -> None:
    """Shared by `preflight` and `validate --live`: run, print, exit 1 on a failed error check."""
    from kimictl.pipeline import prepare
    from kimictl.preflight import run_preflight

    p = prepare(inventory, topology)
    report = run_preflight(p.inventory, p.plan, timeout=timeout, accept_new_keys=accept_new_host_keys,
                           skip=set(skip_check or []))
    from kimictl.state import save_preflight

    save_preflight(p.plan.cluster, report.to_json())
    if output == Output.json:
        emit_json({**(extra or {}), **report.to_json()})
    else:
        from kimictl.cli.views import preflight_view, print_to_stdout

        print_to_stdout(preflight_view(report))
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)


@handle_errors
def preflight(inventory: InventoryOpt, topology: TopologyOpt, output: OutputOpt = Output.text,
              accept_new_host_keys: HostKeysOpt = False, skip_check: SkipOpt = None,
              timeout: TimeoutOpt = 30.0) -> None:
    """Check every host over SSH against the plan: NPUs, versions, links, device ping mesh, disk, ports, clock."""
    run_and_print(inventory, topology, output, accept_new_host_keys, skip_check, timeout)
