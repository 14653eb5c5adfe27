"""Build, validate, start and stop the P/D serving roles (prefill, decode, router) from environment variables.

The launchers in ``scripts/pd/`` and the Docker entry point are thin wrappers around this package, so the
commands are built in one place. The default is the documented GLM-5.1-FP8 deployment: one prefill node with
CP8 (``--tp-size 8 --attn-cp-size 8 --enable-prefill-cp --cp-strategy interleave``), one decode node
(``--tp-size 8 --attn-dp-size 8``) and the router in front of both.

    python -m sglang_cpkv.pd_launch dry-run [ROLE ...]   # print the commands; run the servers' start-up checks
    python -m sglang_cpkv.pd_launch print ROLE           # the command, shell-quoted (secrets redacted)
    python -m sglang_cpkv.pd_launch start ROLE           # background, log file, pid record, health wait
    python -m sglang_cpkv.pd_launch run ROLE             # foreground (container entry point), pid record, log tee'd
    python -m sglang_cpkv.pd_launch up                   # one host: prefill, decode, router in order
    python -m sglang_cpkv.pd_launch wait ROLE            # health wait only
    python -m sglang_cpkv.pd_launch status [ROLE ...]    # healthy: our process alive, on its port, /health 200
    python -m sglang_cpkv.pd_launch stop [ROLE ...]      # ends only the process groups the pid records name

Modules, by job: :mod:`.config` (the ``PD_*`` settings), :mod:`.commands` (each role's argv and
environment), :mod:`.redaction` (secret values out of everything printed or logged), :mod:`.dry_run`
and :mod:`.startup_check` (the checks, run by ``PD_PYTHON``), :mod:`.lifecycle` (the supervisor,
processes, pid records, health), :mod:`.logs` (rotated logs that never block a server), :mod:`.cli`.

``dry-run`` runs, with ``PD_PYTHON`` (the interpreter that will serve) and each role's environment, what
the servers run at start-up before they touch a GPU: upstream's own ``ServerArgs`` parser (so a patched
upstream accepts our patch queue's flags; abbreviations refused) and, when the model's ``config.json``
is on this machine (a local ``PD_MODEL_PATH`` directory or the Hugging Face cache; nothing is
downloaded), upstream's resolution of the server arguments, which runs our
``--enable-cp-shared-kv`` checks and the DSA backend guards of the patch queue, for a GPU of
``PD_GPU_CAPABILITY``. The router flags go through ``sglang_router``'s own parser.

Environment (defaults in ``ENV_DEFAULTS``; every server gets both DSA backends so that prefill and decode
agree on the KV row layout):
  PD_MODEL_PATH (unset: the default model; set but empty: an error), PD_PYTHON (interpreter that runs the
  roles and their checks), PD_TRUST_REMOTE_CODE (0/1),
  PD_TRANSFER_BACKEND, PD_IB_DEVICE, PD_BOOTSTRAP_PORT, PD_DSA_PREFILL_BACKEND, PD_DSA_DECODE_BACKEND,
  PD_KV_CACHE_DTYPE (``--kv-cache-dtype`` of both servers; default fp8_e4m3: upstream's ``auto`` is bf16 on Hopper),
  PD_PREFILL_HOST, PD_PREFILL_PORT, PD_PREFILL_TP, PD_PREFILL_CP, PD_PREFILL_DP, PD_CP_STRATEGY,
  PD_PREFILL_BASE_GPU_ID, PD_CHUNKED_PREFILL_SIZE, PD_PREFILL_MEM_FRACTION_STATIC and
  PD_DECODE_MEM_FRACTION_STATIC (``--mem-fraction-static``, or ``auto`` for upstream's own default; the prefill's
  default 0.85: upstream's leaves the default prefill at chunk 65536 on 8 x H200 no KV budget), PD_CP_SHARED_KV (0/1: ``--enable-cp-shared-kv``, a flag
  of our patch queue, on the prefill server, with ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1`` there;
  the decode follows the mode the prefill publishes), PD_PREFILL_EXTRA_ARGS,
  PD_DECODE_HOST, PD_DECODE_PORT, PD_DECODE_TP, PD_DECODE_DP, PD_DECODE_BASE_GPU_ID,
  PD_DECODE_CUDA_GRAPH_MAX_BS, PD_DECODE_EXTRA_ARGS,
  PD_ROUTER_HOST, PD_ROUTER_PORT, PD_PREFILL_URL, PD_DECODE_URL (how the router reaches the servers; both
  or neither, default loopback: the router hands the prefill URL's host to every decode request as the
  prefill's bootstrap address, so a loopback URL beside a remote one is refused, and a loopback URL must
  name the role's port), PD_ROUTER_EXTRA_ARGS,
  PD_LOG_DIR (logs and pid records; an absolute path, so that ``stop`` and ``status`` find the records from
  any directory), PD_LOG_MAX_BYTES (rotate a log at this size; K/M/G suffixes; 64K to 1024G; default 256M), PD_LOG_KEEP
  (rotated files and launch logs kept per role; 1 to 100; default 5), PD_HEALTH_TIMEOUT, PD_STOP_TIMEOUT (seconds:
  SIGTERM, then SIGKILL after it, in every mode; SIGHUP to a foreground role counts as SIGTERM),
  PD_GPU_CAPABILITY (MAJOR.MINOR of the serving GPUs, for the dry-run's resolution; default: this machine's
  GPU, else 10.3, the B300 of the documented deployment; with it, or on a machine without a GPU, the memory of the
  documented GPU of that capability: 9.0 H200, 10.0 B200, 10.3 B300).
NCCL, InfiniBand and transfer-engine settings (``NCCL_*``, ``MC_*``, ``UCX_*``, ``SGLANG_*``) are passed
through from the environment unchanged and written into each log's header. Values of secret-looking flags
(``--api-key``, ``--admin-api-key``, ``--control-plane-api-keys`` and all its values, ``--*-key(s)``,
``--*token*``, ``--*secret*``, ``--*password*``) and of secret-named variables (``HF_TOKEN``, ...) are
redacted in everything printed or logged, the servers' own output included (:mod:`.redaction`); pid
records are 0600, logs 0640; a URL's credentials (``scheme://user:password@host``) are redacted wherever it
appears. Ports are 1-65535, no two roles of one host on one port; ``start`` refuses a port in use, GPUs that a
running role of this host uses and GPUs this host does not have (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``);
``up`` checks every role before it starts any, and a refusal stops nothing. The dry-run also sizes each server's
KV pool as upstream does and refuses a budget that cannot hold one request of the context length.

The launcher imports only the standard library; sglang and sglang_router are imported by
:mod:`.startup_check`, in a ``PD_PYTHON`` process of its own.
"""

from sglang_cpkv.pd_launch.commands import build_command, role_env, router_args, server_args, shell_command
from sglang_cpkv.pd_launch.config import (
    ALL_CP_RANKS_TRANSFER_ENV,
    CP_SHARED_KV_FLAG,
    ENV_DEFAULTS,
    ROLES,
    PDConfig,
    PDLaunchError,
)
from sglang_cpkv.pd_launch.dry_run import dry_run

__all__ = [
    "ALL_CP_RANKS_TRANSFER_ENV",
    "CP_SHARED_KV_FLAG",
    "ENV_DEFAULTS",
    "ROLES",
    "PDConfig",
    "PDLaunchError",
    "build_command",
    "dry_run",
    "role_env",
    "router_args",
    "server_args",
    "shell_command",
]
