#!/usr/bin/env bash
# colocated-0-n0 on a2-node-01: the engine command, run on the host or inside the container.
# Rendered by kimictl for cluster kimi-a2-pair; do not edit.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
set -a
. "$here/colocated-0-n0.env"
set +a
export LD_LIBRARY_PATH=/usr/local/Ascend/ascend-toolkit/latest/python/site-packages/mooncake"${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
if [ -e /usr/lib/aarch64-linux-gnu/libjemalloc.so.2 ]; then export LD_PRELOAD=/usr/lib/aarch64-linux-gnu/libjemalloc.so.2"${LD_PRELOAD:+:${LD_PRELOAD}}"; fi
exec vllm serve /data/models/Kimi-K2.5-W4A8 \
  --host 192.168.20.11 \
  --port 7100 \
  --data-parallel-size 2 \
  --data-parallel-size-local 1 \
  --data-parallel-address 192.168.20.11 \
  --data-parallel-rpc-port 13389 \
  --tensor-parallel-size 8 \
  --served-model-name kimi-k2.5 \
  --enable-expert-parallel \
  --seed 1024 \
  --quantization ascend \
  --trust-remote-code \
  --max-model-len 32768 \
  --mm-encoder-tp-mode data \
  --tool-call-parser kimi_k2 \
  --reasoning-parser kimi_k2 \
  --enable-auto-tool-choice \
  --safetensors-load-strategy prefetch \
  --max-num-seqs 16 \
  --max-num-batched-tokens 8192 \
  --gpu-memory-utilization 0.9 \
  --compilation-config '{"cudagraph_mode":"FULL_DECODE_ONLY"}' \
  --allowed-local-media-path /var/lib/kimi/media \
  --additional-config '{"enable_mlapo":true,"enable_flashcomm1":true}'
