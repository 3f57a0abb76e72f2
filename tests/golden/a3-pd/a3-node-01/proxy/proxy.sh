#!/usr/bin/env bash
# P/D proxy for cluster kimi-a3 on a3-node-01: one --prefill/--decode URL per DP-rank endpoint.
# Rendered by kimictl; do not edit.
set -euo pipefail
exec vllm-router --host 0.0.0.0 \
  --port 8000 \
  --policy round_robin \
  --vllm-pd-disaggregation \
  --prefill http://192.168.10.11:7100 \
  --prefill http://192.168.10.11:7101 \
  --decode http://192.168.10.12:7100 \
  --decode http://192.168.10.12:7101 \
  --decode http://192.168.10.12:7102 \
  --decode http://192.168.10.12:7103
