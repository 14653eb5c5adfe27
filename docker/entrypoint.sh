#!/usr/bin/env bash
# Entry point of the sglang-cpkv image: one P/D role per container, configured by PD_* variables
# (python/sglang_cpkv/pd_launch/__init__.py; e.g. PD_MODEL_PATH, PD_PREFILL_URL, PD_DECODE_URL, PD_PREFILL_TP).
#   prefill | decode | router   run that role in the foreground (output also in $PD_LOG_DIR)
#   dry-run [ROLE ...]          print the commands and run the servers' start-up checks (no GPU needed)
#   status [ROLE ...]           health of the roles (the compose health checks use it)
#   health                      health of the role this container runs (the image's HEALTHCHECK)
#   validate [ARGS ...]         the bs>1 contamination client (scripts/validate_bs_gt1_contamination.py)
#   help                        this text
#   anything else               run as a command (e.g. bash)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The role of this container, for `health` (which the HEALTHCHECK runs without the container's arguments).
role_file="${TMPDIR:-/tmp}/sglang-cpkv.role"

case "${1:-help}" in
  prefill | decode | router) echo "$1" >"$role_file"; exec "$repo/scripts/pd/pd.sh" run "$1" ;;
  dry-run | status) exec "$repo/scripts/pd/pd.sh" "$@" ;;
  health)
    if [ ! -f "$role_file" ]; then
      echo "no P/D role runs in this container"
      exit 0
    fi
    exec "$repo/scripts/pd/pd.sh" status "$(cat "$role_file")"
    ;;
  validate) shift; exec "${PD_PYTHON:-python3}" "$repo/scripts/validate_bs_gt1_contamination.py" "$@" ;;
  help | -h | --help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) exec "$@" ;;
esac
