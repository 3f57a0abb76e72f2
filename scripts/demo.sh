#!/usr/bin/env bash
# The main job on the embedded default: a local simulated Atlas cluster (2 x Atlas 800 A3, network
# namespaces + sshd + Ascend tool doubles + simulated vLLM-Ascend engines), a3-pd deployed to it.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/bootstrap.sh
K="$ROOT/.venv/bin/kimictl"
D=${KIMICTL_SANDBOX_DIR:-/var/tmp/kimictl-sandbox}
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "kimictl sandbox up --hosts 2 --hardware atlas-800-a3 --dir $D"
"$K" sandbox up --hosts 2 --hardware atlas-800-a3 --dir "$D"
step "kimictl plan -i $D/inventory.yml --topology a3-pd"
"$K" plan -i "$D/inventory.yml" --topology a3-pd
step "kimictl deploy -i $D/inventory.yml --topology a3-pd --yes   (preflight, release, engines, proxy, smoke)"
"$K" deploy -i "$D/inventory.yml" --topology a3-pd --yes
step "kimictl status -i $D/inventory.yml"
"$K" status -i "$D/inventory.yml" || true
proxy=$("$K" render -i "$D/inventory.yml" --topology a3-pd --output json \
        | "$ROOT/.venv/bin/python" -c 'import json,sys; p=json.load(sys.stdin)["proxy"]; print("%s:%s" % (p["host"], p["port"]))')
step "one completion through the P/D proxy at http://$proxy"
curl -sS "http://$proxy/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "kimi-k2.5", "prompt": "Explain prefill/decode disaggregation in one sentence.", "max_tokens": 24}'
echo
step "done"
cat <<MSG
The sandbox keeps running. Try:
  $K status -i $D/inventory.yml --output json
  $K preflight -i $D/inventory.yml --topology a3-pd
  $K sandbox fault engine-crash:atlas-02:decode --dir $D
  ssh -F $D/ssh_config atlas-01 npu-smi info
Tear it down (removes every namespace, mount and process it made):
  $K sandbox down --dir $D
MSG
