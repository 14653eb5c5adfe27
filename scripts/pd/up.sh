#!/usr/bin/env bash
# One host: start prefill, decode and router in order, each after the previous one is healthy; on a failure
# everything started so far is stopped again. The servers' URLs must be loopback and their GPUs disjoint
# (unset, PD_DECODE_BASE_GPU_ID follows the prefill's GPUs: PD_PREFILL_BASE_GPU_ID + PD_PREFILL_TP).
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/pd.sh" up
