#!/usr/bin/env bash
# One copy of the P/D router (vllm-ascend-proxy) for cluster kimi-a3, run inside quay.io/ascend/vllm-ascend:v0.23.0.post1-a3:
# the engines' image, so the proxy is the same vllm-ascend version as the engines. kimictl's proxy front starts it
# with the command to run in the image and appends --host 127.0.0.1 --port PORT. Rendered by kimictl; do not edit.
set -euo pipefail
port=${*: -1}
name=kimi-kimi-a3-proxy-copy-$port
# A SIGKILLed `docker run` client leaves its container (and the port) behind; a restart must not trip over it.
docker rm -f "$name" >/dev/null 2>&1 || true
# --env NAME without a value passes the variable through (the engines' API key, when set), never on a command line.
exec docker run --rm --name "$name" --net=host --env OPENAI_API_KEY quay.io/ascend/vllm-ascend:v0.23.0.post1-a3 "$@"
