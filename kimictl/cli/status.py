"""`kimictl status`: engines, P/D pairs, proxy and drift; exit 0 healthy, 3 degraded, 1 down."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from kimictl.cli.common import InventoryOpt, Output, OutputOpt, emit_json, handle_errors
from kimictl.errors import EXIT_DEGRADED, EXIT_FAILED, EXIT_OK

EXIT_BY_STATE = {"healthy": EXIT_OK, "degraded": EXIT_DEGRADED, "down": EXIT_FAILED}


@handle_errors
def status(
    inventory: InventoryOpt,
    output: OutputOpt = Output.text,
    watch: Annotated[float | None, typer.Option("--watch", help="Refresh every N seconds until Ctrl-C.")] = None,
    no_pair_probe: Annotated[bool, typer.Option("--no-pair-probe",
                                                help="Skip the probe request through the proxy.")] = False,
) -> None:
    """Show every engine's state, the P/D pair probe, the proxy and release drift."""
    from kimictl.inventory import load_inventory
    from kimictl.status import collect_status

    inv = load_inventory(inventory)
    while True:
        doc = collect_status(inv, probe_pairs=not no_pair_probe)
        if output == Output.json:
            emit_json(doc)
        else:
            from kimictl.cli.views import print_to_stdout, status_view

            print_to_stdout(status_view(doc))
        if not watch:
            break
        time.sleep(watch)
    raise typer.Exit(EXIT_BY_STATE[doc["state"]])
