#!/usr/bin/env bash
# One host: start prefill, decode and router in order, each after the previous one is healthy.
# On failure everything started so far is stopped again.
set -euo pipefail
here="$(dirname "${BASH_SOURCE[0]}")"
for role in prefill decode router; do
  if ! "$here/pd.sh" start "$role"; then
    "$here/pd.sh" stop
    exit 1
  fi
done
"$here/pd.sh" status
