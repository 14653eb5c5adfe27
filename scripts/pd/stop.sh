#!/usr/bin/env bash
# Stop every role the launchers started (router, decode, prefill), by recorded process group only.
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/pd.sh" stop "$@"
