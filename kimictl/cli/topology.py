"""`kimictl topology import`: an upstream vllm-ascend multi-node recipe as a kimictl topology file."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kimictl.cli.common import Output, OutputOpt, emit_json, handle_errors, writing_out
from kimictl.errors import InvalidInput

app = typer.Typer(help="Topology files: import vllm-ascend's recipes (`kimictl topologies` lists the presets).",
                  no_args_is_help=True, rich_markup_mode=None)


@app.command("import")
@handle_errors
def import_(
    recipe: Annotated[Path, typer.Argument(help="vllm-ascend recipe: tests/e2e/*/multi_node/external_dp/config/"
                                                "*.yaml of its source (e.g. the PyPI sdist).")],
    out: Annotated[Path | None, typer.Option("--out", help="Write the topology here (default: print it).")] = None,
    version: Annotated[str | None, typer.Option(
        "--version", help="vllm-ascend version whose spellings and base env apply (default: the default profile, "
                          "as kimi_vllm_ascend_version).")] = None,
    name: Annotated[str | None, typer.Option("--name", help="Topology name (default: from the file name).")] = None,
    output: OutputOpt = Output.text,
) -> None:
    """Turn an upstream P/D recipe into a kimictl topology; list kimictl's deviations and what did not map."""
    from kimictl.recipe import import_recipe

    _check_import_flags(out, version, name)
    result = import_recipe(recipe, version=version, name=name)
    text = result.yaml()
    if out is not None:
        with writing_out(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
    if output == Output.json:
        emit_json({"topology": result.topology, "out": str(out) if out else None, "source": result.source,
                   "test_name": result.test_name, "version": result.version, "hosts": result.hosts,
                   "hardware": result.hardware, "model_id": result.model_id, "known_model": result.known_model,
                   "deviations": [d.model_dump() for d in result.deviations],
                   "unmapped": [u.model_dump() for u in result.unmapped]})
        return
    # Without --out the topology goes to stdout (redirectable), the report to stderr.
    report = sys.stdout if out else sys.stderr
    if out is None:
        sys.stdout.write(text)
    else:
        report.write(f"wrote {out}: topology {result.topology['name']} for {result.hosts} {result.hardware} host(s)\n")
    report.write(f"inventory: {result.hosts} {result.hardware} host(s), kimi_model_id: {result.model_id}"
                 + ("" if result.known_model else " (no kimictl model facts: HBM estimated with Kimi K2.5's)")
                 + f", kimi_vllm_ascend_version: {result.version}\n")
    report.write(f"{len(result.deviations)} deliberate deviation(s) (kimictl/data/deviations.yml):\n")
    for d in result.deviations:
        report.write(f"  {d.id}: {d.detail}\n")
    report.write(f"{len(result.unmapped)} item(s) not mapped:\n" if result.unmapped else "everything mapped\n")
    for u in result.unmapped:
        report.write(f"  {u.where}: {u.what} - {u.why}\n")
    if out is not None:
        report.write(f"next: kimictl plan -i INVENTORY --topology {out}\n")


def _check_import_flags(out: Path | None, version: str | None, name: str | None) -> None:
    """The flags, before the recipe is read: each refusal names its flag."""
    import re

    from kimictl.facts import version_profile
    from kimictl.topology import NAME_PATTERN

    if out is not None and (not str(out).strip() or out.is_dir()):
        raise InvalidInput(f"--out {out}: {'is empty' if not str(out).strip() else 'is a directory'}; give the "
                           "topology file to write", hint="e.g. --out topologies/k25-2p1d.yml")
    if version is not None:
        try:
            version_profile(version)
        except InvalidInput as exc:
            raise InvalidInput(f"--version {version}: {exc.message.split(': ', 1)[-1]}") from None
    if name is not None and not re.fullmatch(NAME_PATTERN, name):
        raise InvalidInput(f"--name {name!r}: a topology name is 1-63 lower-case letters, digits, '.', '_' or '-', "
                           "starting with a letter or digit")
