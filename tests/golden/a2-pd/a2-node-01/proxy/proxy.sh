#!/usr/bin/env bash
# P/D proxy for cluster kimi-a2 on a2-node-01: one --prefill/--decode URL per DP-rank endpoint.
# Rendered by kimictl; do not edit.
set -euo pipefail
exec vllm-router --host 0.0.0.0 \
  --port 8000 \
  --policy round_robin \
  --vllm-pd-disaggregation \
  --prefill http://192.168.20.11:7100 \
  --prefill http://192.168.20.12:7100 \
  --decode http://192.168.20.13:7100 \
  --decode http://192.168.20.13:7101 \
  --decode http://192.168.20.14:7100 \
  --decode http://192.168.20.14:7101
