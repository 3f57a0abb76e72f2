#!/bin/bash
# Stands in for systemd-run in the supervisor's tests: records its arguments, applies --setenv, and starts the
# command after "--" detached (own session, no stdio), as systemd starts a transient service.
printf '%s\n' "$@" > "${FAKE_SYSTEMD_RUN_LOG:?}"
envs=()
while [[ $# -gt 0 && $1 != -- ]]; do
  [[ $1 == --setenv=* ]] && envs+=("${1#--setenv=}")
  shift
done
shift
{ cd / && exec setsid env "${envs[@]}" "$@"; } </dev/null >/dev/null 2>&1 &
