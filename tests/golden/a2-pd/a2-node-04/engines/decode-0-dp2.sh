#!/usr/bin/env bash
# decode-0-dp2 on a2-node-04: the engine command, run on the host or inside the container.
# Rendered by kimictl for cluster kimi-a2; do not edit.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
set -a
. "$here/decode-0-dp2.env"
set +a
export LD_LIBRARY_PATH=/usr/local/Ascend/ascend-toolkit/latest/python/site-packages/mooncake"${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
if [ -e /usr/lib/aarch64-linux-gnu/libjemalloc.so.2 ]; then export LD_PRELOAD=/usr/lib/aarch64-linux-gnu/libjemalloc.so.2"${LD_PRELOAD:+:${LD_PRELOAD}}"; fi
exec vllm serve /data/models/Kimi-K2.5-W4A8 \
  --host 192.168.20.14 \
  --port 7100 \
  --data-parallel-size 4 \
  --data-parallel-rank 2 \
  --data-parallel-address 192.168.20.13 \
  --data-parallel-rpc-port 12321 \
  --tensor-parallel-size 4 \
  --served-model-name kimi-k2.5 \
  --enable-expert-parallel \
  --seed 1024 \
  --quantization ascend \
  --trust-remote-code \
  --max-model-len 32768 \
  --no-enable-prefix-caching \
  --mm-encoder-tp-mode data \
  --tool-call-parser kimi_k2 \
  --reasoning-parser kimi_k2 \
  --enable-auto-tool-choice \
  --safetensors-load-strategy prefetch \
  --max-num-seqs 16 \
  --max-num-batched-tokens 128 \
  --gpu-memory-utilization 0.9 \
  --compilation-config '{"cudagraph_mode":"FULL_DECODE_ONLY"}' \
  --allowed-local-media-path /var/lib/kimi/media \
  --additional-config '{"enable_mlapo":true,"recompute_scheduler_enable":true,"multistream_overlap_shared_expert":false}' \
  --kv-transfer-config '{"kv_connector":"MooncakeConnectorV1","kv_role":"kv_consumer","kv_port":"28100","engine_id":"decode-0","kv_connector_extra_config":{"prefill":{"dp_size":2,"tp_size":8},"decode":{"dp_size":4,"tp_size":4}}}'
