#!/usr/bin/env bash
# CI pipeline for a kimictl-managed cluster: validate -> plan (diff kept as an artifact) -> deploy or rollout ->
# status gate.
# Usage: INVENTORY=inventories/prod.yml TOPOLOGY=a3-pd ARTIFACTS=out bash examples/ci/pipeline.sh
# Rolling change of a running P/D cluster instead of a deploy (canary first, slice by slice, automatic rollback):
#   ROLLOUT="decode.serve.max-num-seqs=16 prefill.env.HCCL_BUFFSIZE=512" [ROLLOUT_FLAGS="--allow-proxy-restart"] ...
# Every kimictl command is non-interactive here (--yes, no TTY) and writes JSON artifacts.
set -euo pipefail
: "${INVENTORY:?set INVENTORY}" "${TOPOLOGY:?set TOPOLOGY}"
ARTIFACTS=${ARTIFACTS:-ci-artifacts}
KIMICTL=${KIMICTL:-kimictl}
mkdir -p "$ARTIFACTS"

# 1. Static checks: bad input fails the job with exit 2 and a message naming file:line, host and key.
"$KIMICTL" validate -i "$INVENTORY" --topology "$TOPOLOGY" --output json > "$ARTIFACTS/validate.json"

# 2. Plan and the diff against what is deployed (exit 3 = changes pending, not an error).
set +e
"$KIMICTL" plan -i "$INVENTORY" --topology "$TOPOLOGY" --detailed-exitcode --output json > "$ARTIFACTS/plan.json"
plan_rc=$?
set -e
case $plan_rc in
  0) echo "plan: nothing to change"; changes=0 ;;
  3) echo "plan: changes pending"; changes=1 ;;
  *) exit "$plan_rc" ;;
esac

# 3. Live checks on every host, then converge (deploy runs preflight again and rolls back on failure).
"$KIMICTL" preflight -i "$INVENTORY" --topology "$TOPOLOGY" --output json > "$ARTIFACTS/preflight.json"
if [ -n "${ROLLOUT:-}" ]; then
  # 3b. Rolling change: --check keeps the slices, batches and order as an artifact; a failed gate rolls the
  #     touched slices back, keeps the previous release current and fails the job (exit 1); exit 2 = refused.
  sets=()
  for kv in $ROLLOUT; do sets+=(--set "$kv"); done
  # shellcheck disable=SC2086  # ROLLOUT_FLAGS is a list of flags
  "$KIMICTL" rollout -i "$INVENTORY" --topology "$TOPOLOGY" "${sets[@]}" ${ROLLOUT_FLAGS:-} --check \
    --output json > "$ARTIFACTS/rollout-check.json"
  # shellcheck disable=SC2086
  "$KIMICTL" rollout -i "$INVENTORY" --topology "$TOPOLOGY" "${sets[@]}" ${ROLLOUT_FLAGS:-} --yes \
    --output json > "$ARTIFACTS/rollout.json"
elif [ "$changes" = 1 ]; then
  "$KIMICTL" deploy -i "$INVENTORY" --topology "$TOPOLOGY" --yes --check --diff --output json \
    > "$ARTIFACTS/deploy-check.json"
  "$KIMICTL" deploy -i "$INVENTORY" --topology "$TOPOLOGY" --yes --output json > "$ARTIFACTS/deploy.json"
fi

# 4. Gate: healthy (0) passes; degraded (3) or down (1) fails the job and keeps a redacted bundle.
if ! "$KIMICTL" status -i "$INVENTORY" --output json > "$ARTIFACTS/status.json"; then
  "$KIMICTL" logs -i "$INVENTORY" --bundle "$ARTIFACTS/diagnostics.tar.gz" || true
  exit 1
fi
