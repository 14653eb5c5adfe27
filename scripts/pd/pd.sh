#!/usr/bin/env bash
# All P/D roles through one command: the pd_launch CLI with this repo's interpreter set-up.
#   scripts/pd/pd.sh dry-run              # every role's command, validated on CPU
#   scripts/pd/pd.sh start prefill        # then decode, then router
#   scripts/pd/pd.sh status | stop        # stop: router, decode, prefill (only what was started here)
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
pd_cli "$@"
