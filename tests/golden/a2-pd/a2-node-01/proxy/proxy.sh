#!/usr/bin/env bash
# P/D proxy for cluster kimi-a2 on a2-node-01: kimictl's front on port 8000
# (no API key), 2 vllm-router copies behind it with one --prefill/--decode URL per
# DP-rank endpoint. Rendered by kimictl; do not edit.
set -euo pipefail
exec python3 /var/lib/kimi/bin/proxy_front.py run \
  --listen 0.0.0.0:8000 \
  --state /var/lib/kimi/run/proxy-front/state.json \
  --router 8001:8002 \
  --router 8003:8004 \
  --admin-key-file /var/lib/kimi/secrets/proxy-admin-key \
  --max-connections 1024 \
  --max-body 268435456 \
  --header-timeout 10 \
  --io-timeout 30 \
  --idle-timeout 75 \
  -- vllm-router \
  --policy round_robin \
  --vllm-pd-disaggregation \
  --prefill http://192.168.20.11:7100 \
  --prefill http://192.168.20.12:7100 \
  --decode http://192.168.20.13:7100 \
  --decode http://192.168.20.13:7101 \
  --decode http://192.168.20.14:7100 \
  --decode http://192.168.20.14:7101
