#!/usr/bin/env bash
# P/D proxy for cluster kimi-a3 on a3-node-01: kimictl's front on port 8000
# (no API key), 2 vllm-ascend-proxy copies behind it, each with one
# --prefiller-hosts/--prefiller-ports (--decoder-hosts/--decoder-ports) entry per DP-rank endpoint.
# Rendered by kimictl; do not edit.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"  # the copies run ./router.container.sh of this release
exec python3 /var/lib/kimi/bin/proxy_front.py run \
  --listen 0.0.0.0:8000 \
  --state /var/lib/kimi/run/proxy-front/state.json \
  --router 8001:8002 \
  --router 8003:8004 \
  --router-health /healthcheck \
  --no-router-metrics \
  --admin-key-file /var/lib/kimi/secrets/proxy-admin-key \
  --max-connections 1024 \
  --max-body 268435456 \
  --header-timeout 10 \
  --io-timeout 30 \
  --idle-timeout 75 \
  -- bash ./router.container.sh python3 /vllm-workspace/vllm-ascend/examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py \
  --prefiller-hosts 192.168.10.11 192.168.10.11 \
  --prefiller-ports 7100 7101 \
  --decoder-hosts 192.168.10.12 192.168.10.12 192.168.10.12 192.168.10.12 \
  --decoder-ports 7100 7101 7102 7103 \
  --waiting-retry-interval 1 \
  --max-waiting-retries 120 \
  --log-level INFO
