#!/usr/bin/env bash
# Install what is needed and run the whole test suite (unit tests first, then sandbox tests when root).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/bootstrap.sh
export PATH="$ROOT/.venv/bin:$PATH"
.venv/bin/ruff check kimictl tests bench
markers=""
if [ "$(id -u)" != 0 ]; then
  echo "test.sh: not root, skipping sandbox tests (they need network namespaces)" >&2
  markers="not sandbox"
fi
# Real-engine lane: vLLM's CPU build in a venv outside the clone (built once, ~7 min; reused after).
if [ "${KIMICTL_SKIP_REAL_ENGINE:-0}" != 1 ] && lane=$(bash scripts/vllm_lane.sh); then
  export KIMICTL_VLLM_PYTHON="$lane"
else
  echo "test.sh: real-engine lane unavailable, skipping its tests" >&2
  markers="${markers:+$markers and }not real_engine"
fi
rc=0
.venv/bin/python -m pytest -q ${markers:+-m "$markers"} "$@" || rc=$?

# Host-side code runs on the hosts' own python3, down to the host Python floor (kimictl.HOST_PYTHON_FLOOR): its
# tests run again with that interpreter starting the host code (KIMICTL_HOST_PYTHON).
host_tests=(tests/unit/test_supervisor.py tests/unit/test_proxy_front.py tests/unit/test_weights_agent.py
            tests/unit/test_engine_sim.py tests/unit/test_doubles.py tests/unit/test_reserve_ports.py)
floor=$(.venv/bin/python -c 'from kimictl.sandbox.system import floor_python; print(floor_python() or "")')
if [ -n "$floor" ]; then
  echo "test.sh: host-side tests with $floor ($("$floor" -V 2>&1))" >&2
  KIMICTL_HOST_PYTHON="$floor" .venv/bin/python -m pytest -q -n 2 "${host_tests[@]}" || rc=$?
else
  floor_version=$(.venv/bin/python -c 'import kimictl; print(*kimictl.HOST_PYTHON_FLOOR, sep=".")')
  echo "test.sh: WARNING: no Python $floor_version here (python$floor_version on PATH, \$PYENV_ROOT or" \
       "/root/.pyenv/versions/$floor_version.*): host-side code was NOT tested on the hosts' Python floor" >&2
fi
exit "$rc"
