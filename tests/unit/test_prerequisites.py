"""Prerequisite skips (tests/prerequisites.py): a skip on a developer's machine, a failure under KIMICTL_REQUIRE_ALL=1,
and a run that skipped a test for a missing prerequisite fails under the flag (tests/conftest.py's audit)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prerequisites import NOT_APPLICABLE, REQUIRE_ALL, not_applicable, require_or_skip

pytest_plugins = ["pytester"]
TESTS = Path(__file__).resolve().parents[1]

SUITE = """
import pytest
from prerequisites import not_applicable, require_or_skip

def test_passes():
    pass

def test_plain_skip():
    pytest.skip("no frobnicator here")

@pytest.mark.skipif(True, reason="no widget installed")
def test_marked():
    pass

def test_helper():
    require_or_skip("no gadget on PATH")

def test_does_not_apply():
    not_applicable("an Ascend machine")

@pytest.mark.xfail(reason="known bug")
def test_known_bug():
    assert False
"""
MODULE_SKIP = 'import pytest\npytest.skip("no module prerequisite", allow_module_level=True)\n'


def _flag(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(REQUIRE_ALL, raising=False)
    else:
        monkeypatch.setenv(REQUIRE_ALL, value)


@pytest.mark.parametrize("value", [None, "0", ""])
def test_without_the_flag_a_missing_prerequisite_skips(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    _flag(monkeypatch, value)
    with pytest.raises(pytest.skip.Exception, match=r"^no frobnicator here$"):
        require_or_skip("no frobnicator here")


def test_under_the_flag_a_missing_prerequisite_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_ALL, "1")
    with pytest.raises(pytest.fail.Exception) as exc:
        require_or_skip("no frobnicator here")
    assert str(exc.value) == "missing prerequisite (KIMICTL_REQUIRE_ALL=1 makes it a failure): no frobnicator here"
    assert not exc.value.pytrace


@pytest.mark.parametrize("value", [None, "1"])
def test_not_applicable_skips_with_or_without_the_flag(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    _flag(monkeypatch, value)
    with pytest.raises(pytest.skip.Exception, match=f"^{NOT_APPLICABLE}an Ascend machine$"):
        not_applicable("an Ascend machine")


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    """A small suite beside copies of the repository's tests/conftest.py and tests/prerequisites.py (xdist workers
    import them from there)."""
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(prerequisites=(TESTS / "prerequisites.py").read_text(), test_suite=SUITE,
                        test_module_skip=MODULE_SKIP)
    return pytester


def _audit(lines: list[str]) -> list[str]:
    """The audit's section of a run's output: its header and the lines after it, up to the next header."""
    start = next((i for i, ln in enumerate(lines) if "skipped for a missing prerequisite" in ln), None)
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("=")), len(lines))
    return lines[start:end]


def test_without_the_flag_the_run_passes_with_its_skips(suite: pytest.Pytester,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REQUIRE_ALL, raising=False)
    res = suite.runpytest()
    res.assert_outcomes(passed=1, skipped=5, xfailed=1)
    assert res.ret == pytest.ExitCode.OK and _audit(res.outlines) == []


@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "2"]], ids=["serial", "xdist"])
def test_under_the_flag_a_run_with_prerequisite_skips_fails(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                                            workers: list[str]) -> None:
    """No test fails, yet the run does: three skips (a plain one, a skipif mark, a module's) were not declared as
    not applying here. Under xdist the workers' reports reach the controller's audit."""
    monkeypatch.setenv(REQUIRE_ALL, "1")
    res = suite.runpytest("-k", "not helper", *workers)
    res.assert_outcomes(passed=1, skipped=4, xfailed=1)
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    audit = _audit(res.outlines)
    assert "3 skipped for a missing prerequisite: KIMICTL_REQUIRE_ALL=1 fails the run" in audit[0]
    assert sorted(audit[1:4]) == ["test_module_skip.py: no module prerequisite",
                                  "test_suite.py::test_marked: no widget installed",
                                  "test_suite.py::test_plain_skip: no frobnicator here"]
    assert "an Ascend machine" not in "\n".join(audit)


def test_under_the_flag_the_helper_fails_its_test(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_ALL, "1")
    res = suite.runpytest("-k", "helper", "test_suite.py")
    res.assert_outcomes(failed=1, deselected=5)
    res.stdout.fnmatch_lines(["*missing prerequisite (KIMICTL_REQUIRE_ALL=1 makes it a failure): no gadget on PATH*"])
    assert _audit(res.outlines) == []


def test_under_the_flag_skips_that_do_not_apply_and_xfails_pass(suite: pytest.Pytester,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_ALL, "1")
    res = suite.runpytest("-k", "passes or does_not_apply or known_bug", "test_suite.py")
    res.assert_outcomes(passed=1, skipped=1, xfailed=1, deselected=3)
    assert res.ret == pytest.ExitCode.OK and _audit(res.outlines) == []
