#!/usr/bin/env bash
# Entry point of the sglang-cpkv image: one P/D role per container, configured by PD_* variables
# (python/sglang_cpkv/pd_launch/__init__.py; e.g. PD_MODEL_PATH, PD_PREFILL_URL, PD_DECODE_URL, PD_PREFILL_TP).
#   prefill | decode | router   run that role in the foreground (output also in $PD_LOG_DIR)
#   dry-run [ROLE ...]          print the commands and run the servers' start-up checks (no GPU needed)
#   status [ROLE ...]           health of the roles (the compose health checks use it)
#   health                      health of the role this container runs (the image's HEALTHCHECK)
#   validate [ARGS ...]         the bs>1 contamination client (scripts/validate_bs_gt1_contamination.py)
#   prepare-dirs DIR ...        as root: give the mounted host directories DIR to CPKV_USER (compose runs it)
#   help                        this text
#   anything else               run as a command (e.g. bash)
# A role writes its temporary files (TMPDIR, default /tmp), its logs and pid records (PD_LOG_DIR) and the
# compilers' and models' caches (under $HOME/.cache): with --read-only, mount those (docs/operations.md, "Read-only").
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tmp="${TMPDIR:-/tmp}"
# The role of this container, for `health` (which the HEALTHCHECK runs without the container's arguments).
role_file="$tmp/sglang-cpkv.role"

# Every directory a role writes, checked before it starts: one message naming all that are not writable.
require_writable() {
  local missing=() dir
  for dir in "$tmp" "${PD_LOG_DIR:-/var/log/sglang-cpkv}" "$HOME/.cache"; do
    [ -d "$dir" ] && [ -w "$dir" ] || missing+=("$dir")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "error: not writable by uid $(id -u) in this container: ${missing[*]}" >&2
  echo "  a role writes TMPDIR (${tmp}), PD_LOG_DIR and \$HOME/.cache; with --read-only add" >&2
  echo "  --tmpfs /tmp --tmpfs $HOME/.cache:mode=1777 and mount PD_LOG_DIR from the host (docs/operations.md, \"Read-only\")" >&2
  exit 78 # EX_CONFIG
}

# As root (compose's prepare service): a host directory Docker created for a bind mount is root's and empty. Give
# such a directory to CPKV_USER (uid[:gid], default 10001); leave one the user can already write; refuse any other
# (an operator's own directory is never chowned).
prepare_dirs() {
  local user="${CPKV_USER:-10001}" dir
  local uid="${user%%:*}" gid="${user#*:}"
  [ "$gid" != "$user" ] || gid="$uid"
  [ "$(id -u)" = 0 ] || { echo "error: prepare-dirs runs as root (compose: user \"0:0\")" >&2; exit 78; }
  for dir in "$@"; do
    if [ ! -d "$dir" ]; then
      echo "error: $dir is not a mounted directory" >&2
      exit 78
    elif setpriv --reuid="$uid" --regid="$gid" --clear-groups test -w "$dir"; then
      echo "$dir: writable by $uid:$gid"
    elif [ "$(stat -c %u "$dir")" = 0 ] && [ -z "$(ls -A "$dir")" ]; then
      chown "$uid:$gid" "$dir"
      echo "$dir: empty and root's (made by Docker for the mount): given to $uid:$gid"
    else
      echo "error: $dir is not writable by $uid:$gid: make it so on the host, or set CPKV_USER to its owner" >&2
      exit 78
    fi
  done
}

case "${1:-help}" in
  prefill | decode | router)
    require_writable
    echo "$1" >"$role_file"
    exec "$repo/scripts/pd/pd.sh" run "$1"
    ;;
  dry-run | status) exec "$repo/scripts/pd/pd.sh" "$@" ;;
  health)
    if [ ! -f "$role_file" ]; then
      echo "no P/D role runs in this container"
      exit 0
    fi
    exec "$repo/scripts/pd/pd.sh" status "$(cat "$role_file")"
    ;;
  validate) shift; exec "${PD_PYTHON:-python3}" "$repo/scripts/validate_bs_gt1_contamination.py" "$@" ;;
  prepare-dirs) shift; prepare_dirs "$@" ;;
  help | -h | --help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) exec "$@" ;;
esac
