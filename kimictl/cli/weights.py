"""`kimictl weights pull|verify|status`: stage and check the checkpoint on every host."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from kimictl.cli.common import (
    HostKeysOpt,
    InventoryOpt,
    LimitOpt,
    Output,
    OutputOpt,
    TokenFileOpt,
    WaitOpt,
    cluster_lease,
    emit_json,
    handle_errors,
    stderr_console,
)

app = typer.Typer(help="Stage and check the checkpoint on every host.", no_args_is_help=True, rich_markup_mode=None)


class CliReporter:
    """Rich bars per host and overall on a terminal; a plain line per host every 10% otherwise (CI)."""

    def __init__(self, quiet: bool = False):
        self.err = stderr_console()
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.bars = None
        self.tasks: dict[str, int] = {}
        self.totals: dict[str, int] = {}
        self.done: dict[str, int] = {}
        self.step: dict[str, int] = {}

    def say(self, text: str) -> None:
        if not self.quiet:
            self.err.print(text, highlight=False, markup=False)

    def start(self, totals: dict[str, int]) -> None:
        self.totals = totals
        self.done = dict.fromkeys(totals, 0)
        if self.quiet or not self.tty:
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.bars = Progress(TextColumn("{task.description:>12}"), BarColumn(), DownloadColumn(binary_units=True),
                             TransferSpeedColumn(), TimeRemainingColumn(), console=self.err)
        self.bars.start()
        self.tasks = {h: self.bars.add_task(h, total=t) for h, t in totals.items()}
        self.tasks["all hosts"] = self.bars.add_task("all hosts", total=sum(totals.values()))

    def progress(self, host: str, done: int) -> None:
        self.done[host] = done
        if self.bars is not None:
            self.bars.update(self.tasks[host], completed=done)
            self.bars.update(self.tasks["all hosts"], completed=sum(self.done.values()))
        elif not self.quiet and self.totals.get(host):
            pct = int(100 * done / self.totals[host]) // 10 * 10
            if pct > self.step.get(host, -1):
                self.step[host] = pct
                self.err.print(f"{host}: {pct}% ({done / 2**20:.0f} MiB)", highlight=False)

    def stop(self) -> None:
        if self.bars is not None:
            self.bars.stop()
            self.bars = None


def _table(result) -> None:
    from rich.table import Table

    from kimictl.cli.views import print_to_stdout

    t = Table(title=f"weights {result.action}: {result.cluster}, manifest {result.manifest_digest[:12]}, "
                    f"{result.total_bytes / 2**30:.2f} GiB", title_justify="left")
    for col in ("host", "state", "files", "missing", "corrupt", "received", "hashed"):
        t.add_column(col)
    for h in result.hosts:
        recv = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(h.received.items())) or "-"
        style = {"complete": "green", "incomplete": "yellow"}.get(h.state, "bold red")
        t.add_row(h.host, f"[{style}]{h.state}[/]", f"{h.have}/{h.files}", str(len(h.missing)), str(len(h.bad)),
                  recv, f"{h.bytes_read / 2**20:.0f} MiB in {h.seconds:.1f}s")
    print_to_stdout(t)
    for h in result.hosts:
        if h.error:
            typer.echo(f"{h.host}: {h.error}")
        for p in h.bad[:10]:
            typer.echo(f"{h.host}: corrupt {p}" + (" (removed and fetched again)" if result.action == "pull" else ""))
        for p in h.missing[:10] if result.action != "status" else []:
            typer.echo(f"{h.host}: missing {p}")
        if h.peer_key:
            typer.echo(f"{h.host}: {_peer_key_text(h.peer_key)}")
    for w in result.warnings:
        typer.echo(f"warning: {w}")


def _peer_key_text(key: dict) -> str:
    expires = f"expires {key['expires']} host time" if key.get("expires") else "no expiry"
    if key["state"] == "in use":
        who = key.get("holder") or {}
        return (f"the peer key of a running pull is installed ({expires}; pull by {who.get('user', '?')}@"
                f"{who.get('host', '?')}, pid {who.get('pid', '?')})")
    if key["state"] == "removed":
        return f"removed the peer key an interrupted run left behind ({expires})"
    return f"the peer key of an interrupted run is still installed ({expires}): {key.get('error', '')}"


def _finish(result, output: Output) -> None:
    if output == Output.json:
        emit_json(result.to_json())
    else:
        _table(result)
        typer.echo(f"{'ok' if result.ok else 'NOT OK'} in {result.seconds:.1f}s")
    if not result.ok:
        raise typer.Exit(1)


@app.command()
@handle_errors
def pull(
    inventory: InventoryOpt,
    mode: Annotated[str, typer.Option("--mode", help="sharded (hub shares + peer all-gather), control (push "
                                                     "from --from DIR through the hosts) or shared (verify only).")]
    = "sharded",
    source_dir: Annotated[Path | None, typer.Option("--from", help="A copy of the checkpoint on this machine.")]
    = None,
    streams: Annotated[int, typer.Option("--streams", help="Concurrent peer transfers per host, each way (a hub "
                                         "pull comes on top).")] = 4,
    full: Annotated[bool, typer.Option("--full", help="Re-hash files already verified (ignore stamps).")] = False,
    token_file: TokenFileOpt = None,
    limit: LimitOpt = None,
    wait: WaitOpt = 0.0,
    accept_new_host_keys: HostKeysOpt = False,
    output: OutputOpt = Output.text,
) -> None:
    """Put a verified copy of the checkpoint in kimi_model_dir on every host; moves only missing bytes."""
    from kimictl.inventory import load_inventory
    from kimictl.weights.stage import PullOptions, read_token, validate_opts
    from kimictl.weights.stage import pull as do_pull

    whole = load_inventory(inventory)
    inv = whole.limited(limit)
    opts = PullOptions(mode=mode, streams=streams, full=full, source_dir=source_dir,
                       accept_new_host_keys=accept_new_host_keys,
                       token=read_token(inv.cluster.kimi_model_source, token_file))
    validate_opts(inv, opts)   # before the lease and the hosts
    rep = CliReporter()
    t0 = time.monotonic()
    try:
        with cluster_lease(whole, "weights pull", wait, accept_new_host_keys):
            result = do_pull(inv, opts, rep)
    finally:
        rep.stop()
    if output == Output.text and result.changed:
        moved = sum(sum(h.received.values()) for h in result.hosts)
        typer.echo(f"moved {moved / 2**20:.0f} MiB in {time.monotonic() - t0:.1f}s")
    _finish(result, output)


def _check(action: str, inventory: Path, full: bool, token_file: Path | None, limit: list[str] | None,
           accept_new_host_keys: bool, output: Output) -> None:
    from kimictl.inventory import load_inventory
    from kimictl.weights.stage import PullOptions, check, read_token

    inv = load_inventory(inventory).limited(limit)
    opts = PullOptions(full=full, accept_new_host_keys=accept_new_host_keys,
                       token=read_token(inv.cluster.kimi_model_source, token_file))
    _finish(check(inv, action, opts), output)


@app.command()
@handle_errors
def verify(
    inventory: InventoryOpt,
    full: Annotated[bool, typer.Option("--full", help="Re-hash every file, even unchanged ones.")] = False,
    token_file: TokenFileOpt = None,
    limit: LimitOpt = None,
    accept_new_host_keys: HostKeysOpt = False,
    output: OutputOpt = Output.text,
) -> None:
    """Check every file's hash on every host (unchanged files are trusted from their stamps unless --full)."""
    _check("verify", inventory, full, token_file, limit, accept_new_host_keys, output)


@app.command()
@handle_errors
def status(
    inventory: InventoryOpt,
    token_file: TokenFileOpt = None,
    limit: LimitOpt = None,
    accept_new_host_keys: HostKeysOpt = False,
    output: OutputOpt = Output.text,
) -> None:
    """What each host holds: complete marker, files present, unverified files (sizes only; reads no data)."""
    _check("status", inventory, False, token_file, limit, accept_new_host_keys, output)
