#!/usr/bin/env bash
# decode-0-dp3 on a3-node-02: runs decode-0-dp3.sh inside quay.io/ascend/vllm-ascend:v0.23.0.post1-a3.
# Rendered by kimictl; do not edit.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# A SIGKILLed `docker run` client leaves its container behind; a restart must not trip over the name.
docker rm -f kimi-kimi-a3-decode-0-dp3 >/dev/null 2>&1 || true
exec docker run --rm --name kimi-kimi-a3-decode-0-dp3 \
  --net=host --shm-size=1g \
  --device /dev/davinci0 \
  --device /dev/davinci1 \
  --device /dev/davinci2 \
  --device /dev/davinci3 \
  --device /dev/davinci4 \
  --device /dev/davinci5 \
  --device /dev/davinci6 \
  --device /dev/davinci7 \
  --device /dev/davinci8 \
  --device /dev/davinci9 \
  --device /dev/davinci10 \
  --device /dev/davinci11 \
  --device /dev/davinci12 \
  --device /dev/davinci13 \
  --device /dev/davinci14 \
  --device /dev/davinci15 \
  --device /dev/davinci_manager \
  --device /dev/devmm_svm \
  --device /dev/hisi_hdc \
  -v /usr/local/dcmi:/usr/local/dcmi:ro \
  -v /usr/local/Ascend/driver/tools/hccn_tool:/usr/local/Ascend/driver/tools/hccn_tool:ro \
  -v /usr/local/bin/npu-smi:/usr/local/bin/npu-smi:ro \
  -v /usr/local/Ascend/driver/lib64:/usr/local/Ascend/driver/lib64:ro \
  -v /usr/local/Ascend/driver/version.info:/usr/local/Ascend/driver/version.info:ro \
  -v /etc/ascend_install.info:/etc/ascend_install.info:ro \
  -v /etc/hccn.conf:/etc/hccn.conf:ro \
  -v /data/models/Kimi-K2.5-W4A8:/data/models/Kimi-K2.5-W4A8:ro \
  -v /var/lib/kimi/media:/var/lib/kimi/media:ro \
  -v "$here:$here:ro" \
  quay.io/ascend/vllm-ascend:v0.23.0.post1-a3 bash "$here/decode-0-dp3.sh"
