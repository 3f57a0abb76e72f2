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
exec .venv/bin/python -m pytest -q ${markers:+-m "$markers"} "$@"
