"""`kimictl sandbox up|down|status|fault`: a simulated Atlas cluster on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kimictl.cli.common import Output, OutputOpt, emit_json, handle_errors, stderr_console
from kimictl.errors import InvalidInput

app = typer.Typer(help="Local simulated Atlas 800 A2/A3 cluster (network namespaces + sshd + tool doubles).",
                  no_args_is_help=True)

DEFAULT_DIR = Path("/var/tmp/kimictl-sandbox")
DirOpt = Annotated[Path, typer.Option("--dir", "-d", help="Sandbox directory (state, inventory, keys).")]


def _checked(directory: Path) -> Path:
    """--dir: a directory, or a path that can become one (its first existing ancestor is a directory)."""
    for at in (directory, *directory.parents):
        if at.exists():
            if not at.is_dir():
                what = "is" if at == directory else f"is inside {at}, which is"
                raise InvalidInput(f"--dir/-d {directory} {what} not a directory (the sandbox directory holds its "
                                   "state, inventory and keys)")
            break
    return directory


def _log(msg: str) -> None:
    stderr_console().print(f"[dim]sandbox:[/dim] {msg}", highlight=False)


@app.command()
@handle_errors
def up(
    hosts: Annotated[int, typer.Option("--hosts", "-n", help="Number of fake hosts (1..32).")] = 2,
    hardware: Annotated[str, typer.Option("--hardware", help="atlas-800-a3 or atlas-800-a2.")] = "atlas-800-a3",
    directory: DirOpt = DEFAULT_DIR,
    fault: Annotated[list[str] | None, typer.Option("--fault", "-f", help="Fault SPEC to inject (repeatable).")]
    = None,
    name: Annotated[str, typer.Option("--name", help="kimi_cluster name written to the inventory.")] = "sandbox",
    mode: Annotated[str | None, typer.Option("--mode", help="Force netns or loopback (default: netns if possible).",
                                             hidden=True)] = None,
    checkpoint_mib: Annotated[int, typer.Option("--checkpoint-mib", help="Size of the generated checkpoint the "
                                                "sandbox's fake hub serves (0: no hub).")] = 64,
    checkpoint_shards: Annotated[int, typer.Option("--checkpoint-shards", help="Safetensors shards in it.")] = 8,
    output: OutputOpt = Output.text,
) -> None:
    """Create N fake Atlas hosts reachable over SSH and write DIR/inventory.yml."""
    from kimictl.sandbox.cluster import Sandbox
    from kimictl.sandbox.inject import Injector

    if checkpoint_mib < 0:
        raise InvalidInput(f"--checkpoint-mib {checkpoint_mib} must be >= 0")
    if not 1 <= checkpoint_shards <= 4096:
        raise InvalidInput(f"--checkpoint-shards {checkpoint_shards} must be 1..4096")
    sb = Sandbox(_checked(directory), _log)
    res = sb.up(hosts, hardware, cluster=name, faults=fault or [], mode=mode, checkpoint_bytes=checkpoint_mib * 2**20,
                checkpoint_shards=checkpoint_shards, inject=Injector(sb).apply)
    st = res.state
    if output == Output.json:
        emit_json({"schema_version": 1, "already_up": res.already_up, "seconds": round(res.seconds, 2),
                   "dir": st.dir, "mode": st.mode, "hardware": st.hardware, "inventory": str(res.inventory),
                   "ssh_config": f"{st.dir}/ssh_config", "hosts": [h.model_dump() for h in st.hosts],
                   "faults": st.faults, "hub_url": st.hub_url})
        return
    verb = "already up" if res.already_up else f"up in {res.seconds:.1f}s"
    typer.echo(f"sandbox {verb}: {len(st.hosts)} x {st.hardware} ({st.mode} mode)")
    for h in st.hosts:
        typer.echo(f"  {h.name}  {h.ip}:{h.port}  device ips {h.device_ips[0]}..{h.device_ips[-1]}")
    if st.hub_url:
        typer.echo(f"model hub:  {st.hub_url} (fake; serves the generated checkpoint; `kimictl weights pull`)")
    typer.echo(f"inventory:  {res.inventory}")
    typer.echo(f"ssh:        ssh -F {st.dir}/ssh_config {st.hosts[0].name} npu-smi info")
    typer.echo(f"tear down:  kimictl sandbox down --dir {st.dir}")


@app.command()
@handle_errors
def down(directory: DirOpt = DEFAULT_DIR, output: OutputOpt = Output.text) -> None:
    """Stop every fake host and remove namespaces, links, mounts and files."""
    from kimictl.sandbox.cluster import Sandbox

    removed = Sandbox(_checked(directory), _log).down()
    if output == Output.json:
        emit_json({"schema_version": 1, "dir": str(directory), "removed": removed})
    else:
        typer.echo(f"sandbox down ({len(removed)} objects removed)" if removed else "nothing to tear down")


@app.command()
@handle_errors
def status(directory: DirOpt = DEFAULT_DIR, output: OutputOpt = Output.text) -> None:
    """Show the sandbox hosts, whether their sshd answers, and active faults."""
    from kimictl.errors import EXIT_DEGRADED, EXIT_FAILED
    from kimictl.sandbox.cluster import Sandbox

    doc = Sandbox(_checked(directory)).status()
    if output == Output.json:
        emit_json(doc)
    elif doc["state"] == "absent":
        typer.echo(f"no sandbox in {doc['dir']}")
    else:
        typer.echo(f"sandbox '{doc['cluster']}' is {doc['state']}: {len(doc['hosts'])} x {doc['hardware']}, "
                   f"{doc['mode']} mode, {doc['dir']}")
        py = doc.get("host_python")
        typer.echo(f"  hosts' python3: {py['version']} ({py['path']})" if py else
                   "  hosts' python3: this machine's (no interpreter of the host Python floor found here)")
        for h in doc["hosts"]:
            faults = f"  faults: {', '.join(h['faults'])}" if h["faults"] else ""
            typer.echo(f"  {h['name']:<10} {h['state']:<5} {h['ip']}:{h['port']}{faults}")
    code = {"up": 0, "degraded": EXIT_DEGRADED}.get(doc["state"], EXIT_FAILED)
    if code:
        raise typer.Exit(code)


@app.command()
@handle_errors
def fault(
    spec: Annotated[list[str], typer.Argument(help="npu-unhealthy:HOST:NPU, link-down:HOST:NPU, "
                                                   "driver-mismatch:HOST[:VER], small-disk:HOST[:SIZE], "
                                                   "host-down:HOST, slow-link:HOST:RATE, cut-route:HOST:HOST, "
                                                   "engine-crash:HOST[:ROLE], engine-hang:HOST[:ROLE], "
                                                   "engine-hang-now:HOST[:ROLE], port-taken:HOST:PORT, "
                                                   "clear:HOST|all")],
    directory: DirOpt = DEFAULT_DIR,
    output: OutputOpt = Output.text,
) -> None:
    """Inject faults into (or clear them from) a running sandbox."""
    from kimictl.sandbox.cluster import Sandbox
    from kimictl.sandbox.inject import Injector

    injector = Injector(Sandbox(_checked(directory), _log))
    parsed = [injector.parse(s) for s in spec]   # all specs are checked before any is applied
    active: list[str] = []
    for f in parsed:
        active = injector.apply(f)
    if output == Output.json:
        emit_json({"schema_version": 1, "applied": [f.spec for f in parsed], "active": active})
    else:
        typer.echo("active faults: " + (", ".join(active) if active else "none"))
