#!/usr/bin/env bash
# Create .venv with kimictl and its test extras; install the Debian packages the sandbox needs (as root).
# Sourced by demo.sh and test.sh; safe to run again (does only what is missing).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}

need_pkgs=()
for pair in sshd:openssh-server rsync:rsync ip:iproute2 ping:iputils-ping tc:iproute2; do
  cmd=${pair%%:*}; pkg=${pair#*:}
  command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || need_pkgs+=("$pkg")
done
if [ "${#need_pkgs[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "bootstrap: installing ${need_pkgs[*]}" >&2
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi

# Prometheus (with promtool, for the rule tests) and node_exporter: `kimictl observe up` runs them on the sandbox
# hosts, which see this machine's /usr/bin. ~23 MB download, ~115 MB installed without recommends. Their services
# stay off: the package would start them on this machine's ports.
obs_pkgs=()
command -v promtool >/dev/null 2>&1 || obs_pkgs+=(prometheus)
command -v prometheus-node-exporter >/dev/null 2>&1 || obs_pkgs+=(prometheus-node-exporter)
if [ "${#obs_pkgs[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "bootstrap: installing ${obs_pkgs[*]}" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${obs_pkgs[@]}" >/dev/null
  if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
    systemctl disable --now prometheus prometheus-node-exporter >/dev/null 2>&1 || true
  fi
fi

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "bootstrap: kimictl needs Python >= 3.11 ($PY is $("$PY" -V 2>&1))" >&2
  exit 2
fi
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  if ! "$PY" -m venv "$ROOT/.venv" 2>/dev/null; then
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || { echo "bootstrap: python3-venv missing" >&2; exit 1; }
    rm -rf "$ROOT/.venv"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    "$PY" -m venv "$ROOT/.venv"
  fi
fi
stamp="$ROOT/.venv/.kimictl-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
  echo "bootstrap: installing kimictl into .venv" >&2
  "$ROOT/.venv/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[test]" 2>&1 \
    | grep -v -e '^WARNING: Location' -e 'is ignored' >&2 || true
  "$ROOT/.venv/bin/python" -c 'import kimictl, typer, ansible_runner, paramiko, pytest' || exit 1
  touch "$stamp"
fi
