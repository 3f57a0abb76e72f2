"""Suite-wide: with KIMICTL_REQUIRE_ALL=1 (CI) a skip for a missing prerequisite fails the run (prerequisites.py)."""

from __future__ import annotations

import pytest
from prerequisites import SkipAudit, require_all


def pytest_configure(config: pytest.Config) -> None:
    if require_all() and not hasattr(config, "workerinput"):   # xdist workers' reports reach the controller's
        config.pluginmanager.register(SkipAudit(), "kimictl-skip-audit")
