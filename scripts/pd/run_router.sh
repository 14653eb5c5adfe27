#!/usr/bin/env bash
# Start the P/D router (see common.sh and python/sglang_cpkv/pd_launch/__init__.py for the PD_* settings).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
pd_role_main router "$@"
