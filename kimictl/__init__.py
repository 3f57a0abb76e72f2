"""kimictl: deploy and operate Kimi K2.5 on Atlas 800 A2/A3 with vLLM-Ascend (P/D disaggregated)."""

__version__ = "0.1.0"

# The oldest python3 kimictl's host-side code runs on (openEuler 22.03 ships 3.9): that code is stdlib-only and
# checked against it (ruff's per-file-target-version in pyproject.toml, the host-side tests under this version in
# scripts/test.sh, the sandbox's hosts run it).
HOST_PYTHON_FLOOR = (3, 9)
