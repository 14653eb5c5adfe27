#!/usr/bin/env bash
# Entry point of the sglang-cpkv image: one P/D role per container, configured by PD_* variables
# (python/sglang_cpkv/pd_launch/__init__.py; e.g. PD_MODEL_PATH, PD_PREFILL_TP, PD_PREFILL_CP, PD_DECODE_DP).
#   prefill | decode | router   run that role in the foreground (output also in $PD_LOG_DIR)
#   dry-run [ROLE ...]          print the commands and run the servers' start-up checks (no GPU needed)
#   status [ROLE ...]           health of the roles (the compose health checks use it)
#   validate [ARGS ...]         the bs>1 contamination client (scripts/validate_bs_gt1_contamination.py)
#   help                        this text
#   anything else               run as a command (e.g. bash)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

case "${1:-help}" in
  prefill | decode | router) exec "$repo/scripts/pd/pd.sh" run "$1" ;;
  dry-run | status) exec "$repo/scripts/pd/pd.sh" "$@" ;;
  validate) shift; exec "${PD_PYTHON:-python3}" "$repo/scripts/validate_bs_gt1_contamination.py" "$@" ;;
  help | -h | --help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) exec "$@" ;;
esac
