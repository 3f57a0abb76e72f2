"""One error tree; each error carries the process exit code the CLI maps it to."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2
EXIT_DEGRADED = 3


def did_you_mean(word: str, options, cutoff: float = 0.6) -> str:
    """" (did you mean 'x'?)" for the option closest to a mistyped word, or "" when none is close."""
    import difflib

    close = difflib.get_close_matches(word, list(options), n=1, cutoff=cutoff)
    return f" (did you mean '{close[0]}'?)" if close else ""


def guide(anchor: str) -> str:
    """The operator's guide's row for what a message reports (its troubleshooting table): a hint's pointer."""
    return f"docs/operators.md#{anchor}"


def reported(value: object, limit: int = 80) -> str:
    """A value a host reported, for a message: repr'd (its quotes and line breaks stay data) and cut at `limit`."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


class KimictlError(Exception):
    """Base of every error kimictl reports to a user (never shown as a traceback)."""

    code = EXIT_FAILED

    def __init__(self, message: str, *, details: list[str] | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.details = details or []
        self.hint = hint

    def render(self) -> str:
        lines = [self.message, *(f"  - {d}" for d in self.details)]
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)


class InvalidInput(KimictlError):
    """Bad user input: usage, inventory, topology, infeasible plan. Nothing was changed."""

    code = EXIT_INVALID


class InventoryError(InvalidInput):
    """The inventory file is unreadable or violates the schema."""


class TopologyError(InvalidInput):
    """The topology preset or file is invalid."""


class PlanError(InvalidInput):
    """The inventory and topology do not make a feasible plan."""


class StateError(InvalidInput):
    """A control-node record (release history, current release, a run's snapshot) is damaged or missing; nothing
    was changed. The message names the file (and line) and the hint says how to repair it."""


class RenderError(KimictlError):
    """Rendering failed (a template bug, not user input)."""


class HostError(KimictlError):
    """An operation on a host failed; carries host, step and log tail."""

    def __init__(self, message: str, *, host: str | None = None, step: str | None = None,
                 log_tail: str | None = None, details: list[str] | None = None, hint: str | None = None):
        super().__init__(message, details=details, hint=hint)
        self.host = host
        self.step = step
        self.log_tail = log_tail

    def render(self) -> str:
        head = self.message
        where = ", ".join(p for p in (f"host {self.host}" if self.host else "",
                                      f"step {self.step}" if self.step else "") if p)
        if where:
            head = f"{head} ({where})"
        out = [head, *(f"  - {d}" for d in self.details)]
        if self.log_tail:
            out.append("--- log tail ---")
            out.append(self.log_tail.rstrip())
        if self.hint:
            out.append(f"hint: {self.hint}")
        return "\n".join(out)
