"""kimictl entry point: registers commands; each command module imports its heavy parts lazily."""

from __future__ import annotations

import typer

from kimictl.cli import deploy, heal, lifecycle, logs, observe, preflight, sandbox, static, status, topology, weights
from kimictl.cli import keys as keys_cli
from kimictl.cli import rollout as rollout_cli

app = typer.Typer(
    name="kimictl",
    help="Deploy and operate Kimi K2.5 on Atlas 800 A2/A3 clusters with vLLM-Ascend, prefill/decode disaggregated.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=True,
    rich_markup_mode=None,  # plain help: typer's rich help renderer costs ~130 ms per start
)
app.command()(static.topologies)
app.command()(static.validate)
app.command()(static.plan)
app.command()(static.render)
app.command()(static.schema)
app.command()(preflight.preflight)
app.command()(deploy.deploy)
app.command()(rollout_cli.rollout)
app.command()(deploy.rollback)
app.command()(status.status)
app.command()(heal.heal)
app.command()(status.bench)
app.command()(logs.logs)
app.command()(lifecycle.stop)
app.command()(lifecycle.start)
app.add_typer(weights.app, name="weights")
app.add_typer(sandbox.app, name="sandbox")
app.add_typer(topology.app, name="topology")
app.add_typer(observe.app, name="observe")
app.add_typer(keys_cli.app, name="keys")


def main() -> None:
    app(prog_name="kimictl")  # also under `python -m kimictl`: usage and completion say kimictl
