"""Shared CLI plumbing: option types, output, and the one place errors become exit codes."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from kimictl.errors import InvalidInput, KimictlError

if TYPE_CHECKING:
    from kimictl.inventory import Inventory


class Output(str, Enum):
    text = "text"
    json = "json"


InventoryOpt = Annotated[
    Path, typer.Option("-i", "--inventory", help="Ansible YAML inventory (see `kimictl schema inventory`).")
]
TopologyOpt = Annotated[
    str, typer.Option("--topology", "-t", help="Preset name (`kimictl topologies`) or path to a topology YAML.")
]
OutputOpt = Annotated[Output, typer.Option("--output", "-o", help="text (tables) or json (one document on stdout).")]
# Options several commands share: one definition each, so the name, short form and help never drift apart.
HostKeysOpt = Annotated[bool, typer.Option(
    "--accept-new-host-keys", help="Trust SSH host keys not yet in known_hosts (first contact); default: strict.")]
LimitOpt = Annotated[list[str] | None, typer.Option("--limit", metavar="HOST", help="Only these hosts (repeatable).")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (required without a "
                                                          "terminal).")]
ReadyTimeoutOpt = Annotated[float | None, typer.Option(
    "--ready-timeout", min=1.0, help="Seconds to wait for engines to load (default: sized to the checkpoint).")]
TokenFileOpt = Annotated[Path | None, typer.Option(
    "--token-file", help="Hub token file (mode 0600). Default: MODELSCOPE_API_TOKEN / HF_TOKEN from the environment.")]


def cluster_inventory(path: Path) -> Inventory:
    """The inventory of a cluster the command talks to: load_inventory's checks, and every key the operator
    supplies for the cluster (kimictl/cluster_secrets.py check_supplied_keys): exit 2 before any host is
    contacted."""
    from kimictl.cluster_secrets import check_supplied_keys
    from kimictl.inventory import load_inventory

    inv = load_inventory(path)
    check_supplied_keys(inv)
    return inv


def finite_positive(value: float | None) -> float | None:
    """A callback for options that are durations or targets (seconds, ms): nan, inf, 0 or a negative number is
    refused while the flags are read, before anything else runs (exit 2 naming the option)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{value:g} is not a positive number")
    return value


def _reason(value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise typer.BadParameter("give the reason in words (it is printed and recorded)")
    return value


SkipPreflightOpt = Annotated[str | None, typer.Option("--skip-preflight", metavar="REASON", callback=_reason,
                                                      help="Skip preflight; the reason is printed.")]
WaitOpt = Annotated[float, typer.Option(
    "--wait", metavar="SECONDS", min=0.0, help="When another command holds the cluster lease, wait up to SECONDS for "
                                               "it (default: exit 2 at once, naming the holder).")]

F = TypeVar("F", bound=Callable[..., Any])


def out_dir(value: str | None) -> Path | None:
    """`--out DIR` as given: not empty, and a directory or creatable as one (exit 2 before anything is written)."""
    if value is None:
        return None
    if not value.strip():
        raise InvalidInput("--out is empty: give the directory to write to (it is created when missing)")
    from kimictl.render import check_out_dir

    check_out_dir(Path(value))
    return Path(value)


@contextlib.contextmanager
def writing_out(out: Path | None):
    """Writing the files a user named with --out: a write that fails is exit 2 naming --out, not a crash."""
    try:
        yield
    except OSError as exc:
        if out is None:
            raise
        # write(2) failing (ENOSPC, EIO, EFBIG: /dev/full) names no file: in this block it is a file under --out
        target = Path(os.fsdecode(exc.filename)).absolute() if exc.filename is not None else out.absolute()
        if not (target == out.absolute() or out.absolute() in target.parents):
            raise   # not a file under --out: the operation failing (handle_errors)
        where = f" ({exc.filename})" if target != out.absolute() else ""
        raise InvalidInput(f"--out {out}: cannot write there{where}: {exc.strerror or exc}",
                           hint="give a writable directory") from None


def stderr_console():
    """A rich console on stderr, for progress and diagnostics (stdout stays machine-readable)."""
    from rich.console import Console

    return Console(stderr=True)


def stdout_console():
    from rich.console import Console

    return Console(soft_wrap=True)


def confirm_or_yes(question: str, yes: bool) -> None:
    """The one rule for commands that start, stop or replace what serves on hosts: --yes goes ahead; on a terminal
    the user is asked; without a terminal (CI, scripts, pipes) the command refuses before changing anything."""
    if yes:
        return
    if sys.stdin.isatty() and sys.stderr.isatty():
        typer.confirm(question, abort=True, err=True)
        return
    raise InvalidInput(f"no terminal to confirm on: {question[0].lower()}{question[1:].rstrip('?')} needs --yes; "
                       "nothing was changed", hint="add --yes to run it unattended (CI, scripts)")


@contextlib.contextmanager
def cluster_lease(inv: Any, command: str, wait: float, accept_new_host_keys: bool, *, check: bool = False):
    """Hold the cluster lease (kimictl/lease.py) around the part of a command that changes hosts: exit 2 naming
    the holder when another command holds it (after --wait). `inv` is the whole inventory, not a --limit of it.
    `check`: the command only shows what it would change, so it takes no lease."""
    if check:
        yield
        return
    from kimictl import lease

    err = stderr_console()

    def on_wait(holder: Any) -> None:
        err.print(f"waiting up to {wait:g}s for the cluster lease: {holder.text()} holds it", highlight=False,
                  markup=False, soft_wrap=True)

    with lease.held(inv, command, wait=wait, accept_new_keys=accept_new_host_keys, on_wait=on_wait):
        yield


def reporters(verb: str, events: tuple[str, ...] = ("changed", "failed", "unreachable")):
    """(say, on_event) printing a command's progress and its playbook task results on stderr."""
    err = stderr_console()
    styles = {"changed": "yellow", "failed": "bold red", "unreachable": "bold red"}

    def say(msg: str) -> None:
        err.print(f"[cyan]{verb}[/] {msg}", highlight=False)

    def on_event(host: str, task: str, status: str) -> None:
        if status in events:
            err.print(f"  [{styles[status]}]{status:>11}[/] {host}: {task}", highlight=False)

    return say, on_event


def emit_json(doc: Any) -> None:
    """Print one JSON document on stdout and nothing else."""
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")


DEBUG_ENV = "KIMICTL_DEBUG"  # set (to anything) to get the traceback of an unexpected OS error


def _report(exc: KimictlError, output: Any) -> None:
    if output == Output.json:
        emit_json({"error": {"code": exc.code, "type": type(exc).__name__, "message": exc.message,
                             "details": exc.details, "hint": exc.hint}})
    sys.stderr.write(f"error: {exc.render()}\n")


def _os_failure(exc: OSError) -> KimictlError:
    """An OSError that escaped an operation: exit 1 with the path, pointing at the state dir when it is that."""
    from kimictl.state import control_dir

    what = exc.strerror or str(exc) or type(exc).__name__
    path = exc.filename
    msg = f"{what}: {path}" if path is not None else what
    if exc.filename2 is not None:
        msg += f" -> {exc.filename2}"
    hint = f"set {DEBUG_ENV}=1 to see where it happened"
    if path is not None:
        base, p = control_dir("-").parent.absolute(), Path(os.fsdecode(path)).absolute()
        if p == base or base in p.parents or p in base.parents:
            return KimictlError(f"cannot use the control-node state directory {base}: {msg}",
                                hint="set KIMICTL_STATE_DIR to a writable directory; " + hint)
    return KimictlError(f"the operation failed: {msg}", hint=hint)


def handle_errors(fn: F) -> F:
    """Turn KimictlError into a clear message on stderr and its exit code; never a traceback.

    Input files the user names are checked where they are read (exit 2 naming the file). Any other OSError that
    escapes (a file gone mid-run, a directory that cannot be written, a missing program) is the operation failing:
    exit 1 with the error and its path; KIMICTL_DEBUG=1 shows its traceback instead."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KimictlError as exc:
            _report(exc, kwargs.get("output"))
            raise typer.Exit(exc.code) from None
        except KeyboardInterrupt:
            sys.stderr.write("interrupted\n")
            raise typer.Exit(130) from None
        except BrokenPipeError:
            raise  # stdout's reader went away (`kimictl plan | head`): click ends quietly (exit 1), as it does when
            # the pipe breaks at the last flush
        except OSError as exc:
            if os.environ.get(DEBUG_ENV):
                raise
            failure = _os_failure(exc)
            _report(failure, kwargs.get("output"))
            raise typer.Exit(failure.code) from None

    return wrapper  # type: ignore[return-value]
