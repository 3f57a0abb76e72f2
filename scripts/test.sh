#!/usr/bin/env bash
# Install what is needed and run the whole test suite (unit tests first, then sandbox tests when root).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/bootstrap.sh
export PATH="$ROOT/.venv/bin:$PATH"
.venv/bin/ruff check kimictl tests bench
markers="not real_engine"
if [ "$(id -u)" != 0 ]; then
  echo "test.sh: not root, skipping sandbox tests (they need network namespaces)" >&2
  markers="$markers and not sandbox"
fi
exec .venv/bin/python -m pytest -q -m "$markers" "$@"
