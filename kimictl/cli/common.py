"""Shared CLI plumbing: option types, output, and the one place errors become exit codes."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from kimictl.errors import EXIT_INVALID, KimictlError


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

F = TypeVar("F", bound=Callable[..., Any])


def stderr_console():
    """A rich console on stderr, for progress and diagnostics (stdout stays machine-readable)."""
    from rich.console import Console

    return Console(stderr=True)


def stdout_console():
    from rich.console import Console

    return Console(soft_wrap=True)


def emit_json(doc: Any) -> None:
    """Print one JSON document on stdout and nothing else."""
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def handle_errors(fn: F) -> F:
    """Turn KimictlError into a clear message on stderr and its exit code; never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KimictlError as exc:
            if kwargs.get("output") == Output.json:
                emit_json({"error": {"code": exc.code, "type": type(exc).__name__, "message": exc.message,
                                     "details": exc.details, "hint": exc.hint}})
            sys.stderr.write(f"error: {exc.render()}\n")
            raise typer.Exit(exc.code) from None
        except KeyboardInterrupt:
            sys.stderr.write("interrupted\n")
            raise typer.Exit(130) from None
        except FileNotFoundError as exc:
            sys.stderr.write(f"error: {exc.strerror}: {exc.filename}\n")
            raise typer.Exit(EXIT_INVALID) from None

    return wrapper  # type: ignore[return-value]
