# Shared by the scripts/pd launchers (sourced, not run). Every command is built and checked by one
# Python module, sglang_cpkv.pd_launch; these scripts only pick the interpreter and the role.
#
#   PD_PYTHON         the interpreter that runs the servers, the router and --dry-run's start-up checks: it
#                     has sglang (with our patch queue applied), sglang_router and sglang_cpkv. Default: python3
#                     on PATH (the image's); in a checkout after `make setup`: PD_PYTHON=$PWD/.venv/bin/python.
#   PD_LAUNCH_PYTHON  the interpreter that runs the launcher itself (default: PD_PYTHON; the standard library
#                     is enough).
#   PD_ENV_FILE       optional file of settings read first (e.g. scripts/pd/glm51-fp8-b300.env): `export KEY=VALUE`
#                     lines (shell syntax: quotes and ${VAR:-default} work) and compose-style `KEY=VALUE` lines
#                     (the value taken literally, one pair of surrounding quotes removed), LF or CRLF line
#                     endings, blank lines and `#` comments; any other line is refused with its line number.
# All PD_* variables are described in python/sglang_cpkv/pd_launch/__init__.py.

pd_repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

if [ -n "${PD_ENV_FILE:-}" ]; then
  if [ ! -f "$PD_ENV_FILE" ]; then
    echo "$(basename "$0"): error: PD_ENV_FILE=$PD_ENV_FILE: no such file (a relative path is read from $PWD)" >&2
    exit 2
  fi
  pd_env_line=0
  while IFS= read -r pd_line || [ -n "$pd_line" ]; do
    pd_env_line=$((pd_env_line + 1))
    pd_line="${pd_line%$'\r'}"
    pd_line="${pd_line#"${pd_line%%[![:space:]]*}"}"
    case "$pd_line" in '' | '#'*) continue ;; esac
    if [[ "$pd_line" =~ ^export[[:space:]]+([A-Za-z_][A-Za-z0-9_]*)= ]]; then
      # The operator's own shell line, as sourcing it would run it.
      eval "$pd_line" || {
        echo "$(basename "$0"): error: $PD_ENV_FILE:$pd_env_line: the line failed (${BASH_REMATCH[1]})" >&2
        exit 2
      }
    elif [[ "$pd_line" =~ ^([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]]; then
      pd_value="${BASH_REMATCH[2]}"
      if [[ "$pd_value" =~ ^\"(.*)\"$ || "$pd_value" =~ ^\'(.*)\'$ ]]; then pd_value="${BASH_REMATCH[1]}"; fi
      export "${pd_line%%=*}=$pd_value"
    else
      # The line itself is not printed: it may hold a secret.
      echo "$(basename "$0"): error: $PD_ENV_FILE:$pd_env_line: not a KEY=VALUE or export KEY=VALUE line" >&2
      exit 2
    fi
  done <"$PD_ENV_FILE"
  unset pd_line pd_value pd_env_line
fi

export PD_PYTHON="${PD_PYTHON:-python3}"
pd_python="${PD_LAUNCH_PYTHON:-$PD_PYTHON}"

# Use the installed sglang_cpkv when there is one (the image); otherwise this checkout's copy.
if ! "$pd_python" -c 'import sglang_cpkv.pd_launch' >/dev/null 2>&1; then
  export PYTHONPATH="$pd_repo_root/python${PYTHONPATH:+:$PYTHONPATH}"
fi

pd_cli() {
  exec "$pd_python" -m sglang_cpkv.pd_launch "$@"
}

pd_usage() {
  cat >&2 <<USAGE
usage: $(basename "$0") [--dry-run | --foreground | --no-wait | stop | status]
  (no option)   start the $1 in the background, log to \$PD_LOG_DIR, wait for /health
  --dry-run     print the command and run the server's start-up checks with \$PD_PYTHON (CPU, no GPU)
  --foreground  run in the foreground (output to stdout and the log; pid record for stop)
  --no-wait     start without waiting for /health
  stop          stop the $1 this launcher started (by its process group recorded in \$PD_LOG_DIR)
  status        recorded pid and health (alive, on its port, /health 200; the router: and both servers)
USAGE
}

# pd_role_main ROLE [ARG]: the whole body of run_prefill.sh / run_decode.sh / run_router.sh.
pd_role_main() {
  local role="$1"
  shift
  case "${1:-}" in
    "") pd_cli start "$role" ;;
    --dry-run) pd_cli dry-run "$role" ;;
    --foreground) pd_cli run "$role" ;;
    --no-wait) pd_cli start --no-wait "$role" ;;
    stop) pd_cli stop "$role" ;;
    status) pd_cli status "$role" ;;
    -h | --help) pd_usage "$role"; return 0 ;;
    *) pd_usage "$role"; return 2 ;;
  esac
}
