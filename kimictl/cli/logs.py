"""`kimictl logs`: tail engine and proxy logs, or write a redacted diagnostics tarball (--bundle)."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from kimictl.cli.common import InventoryOpt, Output, OutputOpt, emit_json, handle_errors, stderr_console
from kimictl.errors import EXIT_FAILED, InvalidInput


class Role(str, Enum):
    prefill = "prefill"
    decode = "decode"
    colocated = "colocated"
    proxy = "proxy"


@handle_errors
def logs(
    inventory: InventoryOpt,
    host: Annotated[list[str] | None, typer.Option("--host", help="Only this host (repeatable).")] = None,
    role: Annotated[list[Role] | None, typer.Option("--role", help="Only engines of this role (repeatable).")] = None,
    engine: Annotated[list[str] | None, typer.Option("--engine", help="Only this engine id (repeatable).")] = None,
    lines: Annotated[int, typer.Option("--lines", "-n", min=0, help="Lines per log.")] = 50,
    bundle: Annotated[Path | None, typer.Option("--bundle", metavar="FILE.tar.gz",
                                                help="Write a redacted diagnostics tarball instead.")] = None,
    secrets_file: Annotated[Path | None, typer.Option("--secrets-file", help="More secret values to redact, "
                                                                               "one per line.")] = None,
    max_file_bytes: Annotated[int, typer.Option("--max-file-bytes", min=0, help="With --bundle: keep the last N "
                                                 "bytes of each file (0 = whole files).")] = 32 * 2**20,
    no_redact: Annotated[bool, typer.Option("--no-redact", help="Show tails unredacted (never for --bundle).")]
    = False,
    output: OutputOpt = Output.text,
) -> None:
    """Tail each engine's and the proxy's log, or collect everything into one redacted tarball."""
    from kimictl.cli.common import cluster_inventory
    from kimictl.cluster_secrets import known_keys
    from kimictl.logs import Redactor, build_bundle, check_engine_ids, tail_logs

    inv = cluster_inventory(inventory).limited(host, "--host")
    check_engine_ids(inv, engine or [])
    redactor = Redactor.from_config(secrets_file=secrets_file,
                                    known=known_keys(inv))
    err = stderr_console()
    if redactor.skipped_short:
        err.print(f"[yellow]{redactor.skipped_short} configured secret value(s) shorter than 4 characters are not "
                  "matched literally[/]")
    if bundle is not None:
        if role or engine or no_redact:
            raise InvalidInput("--bundle collects every engine's files, always redacted; --role, --engine and "
                               "--no-redact only apply to tails", hint="narrow a bundle with --host")
        res = build_bundle(inv, bundle, redactor, max_file_bytes=max_file_bytes,
                           say=lambda m: err.print(f"[cyan]logs[/] {m}", highlight=False))
        failed = {h: e for h, e in res.hosts.items() if e != "ok"}
        if output == Output.json:
            emit_json(res.to_json())
        else:
            kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(res.redactions_by_kind.items()))
            typer.echo(f"wrote {res.path}: {res.files} files, {res.bytes} bytes (gzip), {res.redactions} "
                       f"redaction(s)" + (f" ({kinds})" if res.redactions else ""))
            for h, e in failed.items():
                typer.echo(f"  {h}: not collected: {e}")
        if failed:
            sys.stderr.write(f"error: {len(failed)} host(s) could not be collected; the bundle has the rest\n")
            raise typer.Exit(EXIT_FAILED)
        return
    doc = tail_logs(inv, roles=[r.value for r in role or []], engines=engine or None, lines=lines,
                    redactor=None if no_redact else redactor)
    if output == Output.json:
        emit_json(doc)
    else:
        for entry in doc["logs"]:
            typer.echo(f"==> {entry['host']} {entry['id']} ({entry['role']}) {entry['path']} <==")
            if entry["missing"]:
                typer.echo("(no log file)")
            for line in entry["lines"]:
                typer.echo(line)
            typer.echo("")
        if not doc["logs"]:
            typer.echo("no engine or proxy matches" if (role or engine) else "no engine or proxy on these hosts")
        for h in doc["hints"]:
            typer.echo(f"hint: {', '.join(h['engines'])}: {h['count']} line(s) like {h['line'].strip()[-160:]!r}: "
                       f"{h['what']}; see {h['hint']}")
    for e in doc["errors"]:
        sys.stderr.write(f"error: {e['host']}: {e['error']}\n")
    if doc["errors"]:
        raise typer.Exit(EXIT_FAILED)
