"""The P/D launchers: commands checked as the servers check them at start-up (CPU), and the process lifecycle.

The dry-run tests build the default GLM-5.1-FP8 CP8 deployment and feed it to upstream's ServerArgs parser
and sglang_router's parser; a misspelled, abbreviated or ill-chosen flag must fail with their own argparse
error. With a local DSA ``config.json`` the dry-run also runs upstream's resolution of the server
arguments (the model overrides, the DSA backend guards and ``--enable-cp-shared-kv``'s checks), so a
combination the server would refuse at start-up is refused here, with the server's message. Secret
values given to any role never reach what is printed or logged. The lifecycle tests start a stub
"server" (a script standing in for PD_PYTHON) through the real bash launchers, and check the health
wait, the pid record and its mode, that `stop` ends exactly the process group it started, from any
directory, and that a server ignoring SIGTERM is killed after PD_STOP_TIMEOUT, in the background and
in the foreground.
"""

import contextlib
import io
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_cpkv import pd_launch
from sglang_cpkv.pd_launch.redaction import (
    REDACTED,
    StreamScrubber,
    is_secret_flag,
    redact_argv,
    redact_env_value,
    scrub,
    secret_values,
)
from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.dsa_kit import LLAMA_CONFIG
from sglang_cpkv.testing.pd_stub import alive, free_port, listening, wait_for, write_stub_python

register_cpu_ci(est_time=100, suite="cpkv-cpu")

REPO = Path(__file__).resolve().parents[3]
PD = REPO / "scripts" / "pd"
DSA_MODEL = REPO / "test" / "registered" / "upstream" / "fixtures" / "dsa_v32"  # a local DeepseekV32 config.json
GLM51_FP8 = REPO / "python" / "sglang_cpkv" / "capacity" / "models" / "glm-5.1-fp8"  # the default model's config.json
SECRETS = {"PD_PREFILL_EXTRA_ARGS": "--api-key sekrit-api-1 --admin-api-key=sekrit-admin-2"}
SECRET_VALUES = ("sekrit-api-1", "sekrit-admin-2")


def cfg(**env) -> pd_launch.PDConfig:
    return pd_launch.PDConfig.from_env({"PD_PYTHON": sys.executable, **env})


def dry_run_text(config: pd_launch.PDConfig, roles=pd_launch.ROLES) -> str:
    out = io.StringIO()
    pd_launch.dry_run(roles, config, out=out)
    return out.getvalue()


# ---------------------------------------------------------------------------------- dry-run


def test_default_deployment_is_accepted_by_upstream_parsers_and_prints_no_secret():
    text = dry_run_text(cfg(**SECRETS))
    prefill = pd_launch.build_command("prefill", cfg())
    assert prefill[1:3] == ["-m", "sglang.launch_server"]
    for flag in (
        "--enable-prefill-cp",
        "--attn-cp-size",
        "--cp-strategy",
        "--dsa-prefill-backend",
        "--dsa-decode-backend",
    ):
        assert flag in prefill
    assert prefill[prefill.index("--attn-cp-size") + 1] == "8"
    assert prefill[prefill.index("--disaggregation-mode") + 1] == "prefill"
    assert pd_launch.CP_SHARED_KV_FLAG not in prefill  # opt-in only
    assert "--attn-cp-size" not in pd_launch.build_command("decode", cfg())  # upstream refuses CP on decode
    for role in ("prefill", "decode"):
        assert f"# {role}: flags accepted by upstream's ServerArgs parser" in text
        # The hub model's config.json is not on this machine: said, not silently skipped.
        assert f"# {role}: flags accepted by upstream's ServerArgs parser; start-up checks NOT run" in text
    assert "# router: flags accepted by sglang_router's parser" in text  # sglang-router is in dev-cpu.txt
    assert "--api-key '<redacted>' '--admin-api-key=<redacted>'" in text
    assert not any(secret in text for secret in SECRET_VALUES)


def test_cp_shared_kv_flag_is_opt_in_and_only_the_prefill_gets_the_all_ranks_variable():
    config = cfg(PD_CP_SHARED_KV="1")
    assert pd_launch.CP_SHARED_KV_FLAG in pd_launch.build_command("prefill", config)
    assert pd_launch.CP_SHARED_KV_FLAG not in pd_launch.build_command("decode", config)
    # Owner-sharded pages: every prefill CP rank must send; the decode follows the mode the prefill publishes.
    assert pd_launch.role_env("prefill", config) == {pd_launch.ALL_CP_RANKS_TRANSFER_ENV: "1"}
    assert pd_launch.shell_command("prefill", config).startswith(f"{pd_launch.ALL_CP_RANKS_TRANSFER_ENV}=1 ")
    assert (
        pd_launch.role_env("decode", config)
        == pd_launch.role_env("router", config)
        == pd_launch.role_env("prefill", cfg())
        == {}
    )
    with pytest.raises(pd_launch.PDLaunchError, match=f"{pd_launch.ALL_CP_RANKS_TRANSFER_ENV}=1 on the prefill"):
        cfg(PD_CP_SHARED_KV="1", **{pd_launch.ALL_CP_RANKS_TRANSFER_ENV: "0"})


@pytest.mark.parametrize(
    "env, message",
    [
        ({"PD_PREFILL_TP": "6"}, "PD_PREFILL_TP=6 must be divisible by PD_PREFILL_DP * PD_PREFILL_CP"),
        ({"PD_DECODE_PORT": "30o01"}, "PD_DECODE_PORT='30o01' is not an integer"),
        ({"PD_CP_SHARED_KV": "maybe"}, "PD_CP_SHARED_KV='maybe' must be 0 or 1"),
        ({"PD_PREFILL_EXTRA_ARGS": "--x 'unterminated"}, "PD_PREFILL_EXTRA_ARGS: cannot split"),
        ({"PD_MODEL_PATH": ""}, "PD_MODEL_PATH is set but empty"),
        ({"PD_MODEL_PATH": "  "}, "PD_MODEL_PATH is set but empty"),
        ({"PD_LOG_DIR": "pd-logs"}, "PD_LOG_DIR='pd-logs' must be an absolute path"),
        ({"PD_CP_SHARED_KV": "1", "PD_PREFILL_CP": "1"}, "PD_CP_SHARED_KV=1 needs PD_PREFILL_CP > 1"),
        ({"PD_GPU_CAPABILITY": "sm100"}, "PD_GPU_CAPABILITY='sm100' must be MAJOR.MINOR"),
        # The topology: the README's old two-node router (only PD_DECODE_URL) handed every decode the
        # loopback as the prefill's bootstrap host.
        ({"PD_DECODE_URL": "http://node-b:30001"}, "PD_DECODE_URL is set but PD_PREFILL_URL is not"),
        ({"PD_PREFILL_URL": "http://node-a:30000"}, "PD_PREFILL_URL is set but PD_DECODE_URL is not"),
        (
            {"PD_PREFILL_URL": "http://127.0.0.1:30000", "PD_DECODE_URL": "http://node-b:30001"},
            "PD_PREFILL_URL=http://127.0.0.1:30000 is a loopback address but PD_DECODE_URL=http://node-b:30001",
        ),
        (
            {"PD_PREFILL_URL": "http://node-a:30000", "PD_DECODE_URL": "http://localhost:30001"},
            "PD_DECODE_URL=http://localhost:30001 is a loopback address but PD_PREFILL_URL=http://node-a:30000",
        ),
        (
            {"PD_PREFILL_URL": "http://0.0.0.0:30000", "PD_DECODE_URL": "http://node-b:30001"},
            "0.0.0.0 is a listen address",
        ),
        ({"PD_PREFILL_URL": "node-a:30000", "PD_DECODE_URL": "http://node-b:30001"}, "must be http(s)://HOST:PORT"),
        (
            {"PD_PREFILL_URL": "http://127.0.0.1:30005", "PD_DECODE_URL": "http://127.0.0.1:30001"},
            "is this host, port 30005, but the server listens on PD_PREFILL_PORT=30000",
        ),
        ({"PD_PREFILL_PORT": "65536"}, "PD_PREFILL_PORT=65536 is not a TCP port (1-65535)"),
        ({"PD_ROUTER_PORT": "99999"}, "PD_ROUTER_PORT=99999 is not a TCP port"),
        ({"PD_BOOTSTRAP_PORT": "30000"}, "PD_PREFILL_PORT and PD_BOOTSTRAP_PORT are both 30000"),
        ({"PD_DECODE_PORT": "30000"}, "PD_PREFILL_PORT and PD_DECODE_PORT are both 30000"),
        ({"PD_ROUTER_PORT": "30001"}, "PD_DECODE_PORT and PD_ROUTER_PORT are both 30001"),
        (
            # Two nodes: the router runs on one of them, beside either server.
            {"PD_PREFILL_URL": "http://node-a:30000", "PD_DECODE_URL": "http://node-b:8000", "PD_DECODE_PORT": "8000"},
            "PD_DECODE_PORT and PD_ROUTER_PORT are both 8000",
        ),
        ({"PD_LOG_MAX_BYTES": "lots"}, "PD_LOG_MAX_BYTES='lots' must be a positive size"),
        ({"PD_LOG_KEEP": "0"}, "PD_LOG_KEEP=0 must be >= 1"),
        ({"PD_LOG_KEEP": "1000000000"}, "PD_LOG_KEEP=1000000000 must be <= 100"),
        ({"PD_LOG_MAX_BYTES": "1K"}, "PD_LOG_MAX_BYTES='1K' must be between 64K and 1024G bytes"),
        ({"PD_LOG_MAX_BYTES": "5000G"}, "PD_LOG_MAX_BYTES='5000G' must be between 64K and 1024G bytes"),
        ({"PD_PREFILL_MEM_FRACTION_STATIC": "1.5"}, "PD_PREFILL_MEM_FRACTION_STATIC='1.5' must be a fraction"),
        ({"PD_DECODE_MEM_FRACTION_STATIC": "most"}, "PD_DECODE_MEM_FRACTION_STATIC='most' must be a fraction"),
    ],
)
def test_bad_environment_names_the_variable(env, message):
    with pytest.raises(pd_launch.PDLaunchError, match=re.escape(message)):
        cfg(**env)


def test_the_memory_fraction_is_the_prefill_s_own_setting_and_upstream_s_on_the_decode_by_default():
    """The launchers pass --mem-fraction-static to the prefill (upstream's own default leaves GLM-5.1-FP8's prefill on
    8 x H200 at chunk 65,536 no KV budget: 0.258); ``auto`` leaves a server to upstream's heuristic."""
    prefill, decode = pd_launch.build_command("prefill", cfg()), pd_launch.build_command("decode", cfg())
    assert (
        prefill[prefill.index("--mem-fraction-static") + 1] == pd_launch.ENV_DEFAULTS["PD_PREFILL_MEM_FRACTION_STATIC"]
    )
    assert "--mem-fraction-static" not in decode
    given = cfg(PD_PREFILL_MEM_FRACTION_STATIC="auto", PD_DECODE_MEM_FRACTION_STATIC="0.9")
    assert "--mem-fraction-static" not in pd_launch.build_command("prefill", given)
    decode = pd_launch.build_command("decode", given)
    assert decode[decode.index("--mem-fraction-static") + 1] == "0.9"


def pd_dry_run(env: dict, *roles: str) -> subprocess.CompletedProcess:
    """``scripts/pd/pd.sh dry-run ROLES`` with this interpreter as PD_PYTHON, the default model's config.json local."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "PD_PYTHON": sys.executable, **env}
    env.setdefault("PD_MODEL_PATH", str(GLM51_FP8))
    return subprocess.run([PD / "pd.sh", "dry-run", *roles], env=env, capture_output=True, text=True, timeout=600)


ONE_HOST_B300 = {"PD_PREFILL_TP": "4", "PD_PREFILL_CP": "4", "PD_DECODE_TP": "4", "PD_DECODE_DP": "4"}


@pytest.mark.parametrize(
    "settings",
    [
        {"PD_GPU_CAPABILITY": "9.0"},
        {"PD_GPU_CAPABILITY": "10.3", "PD_ENV_FILE": str(PD / "glm51-fp8-b300.env")},
        {"PD_GPU_CAPABILITY": "10.3", **ONE_HOST_B300, "PD_DECODE_BASE_GPU_ID": "4"},
    ],
    ids=["h200", "b300-env-file", "b300-one-host"],
)
def test_the_default_deployment_holds_one_request_of_the_context_length(settings):
    """Issue 54: the dry-run sizes each server's KV pool as upstream does from the --mem-fraction-static upstream
    resolves for it on the GPU (PD_GPU_CAPABILITY: its documented memory), and the default deployment on each
    documented GPU holds one request of GLM-5.1's 202,752-token context on the prefill and on the decode."""
    done = pd_dry_run(settings, "prefill", "decode")
    assert done.returncode == 0, done.stderr[-3000:]
    for role in ("prefill", "decode"):
        (line,) = [line for line in done.stdout.splitlines() if line.startswith(f"# {role}: flags accepted")]
        assert "KV budget per GPU: --mem-fraction-static" in line, line
        assert "one request of the context length (202,752 tokens) fits" in line, line
    assert "--mem-fraction-static 0.85 (as given)" in done.stdout


@pytest.mark.parametrize(
    ("fraction", "fragments"),
    [
        ("auto", ["--mem-fraction-static 0.258 (upstream's default for this server)", "no KV budget"]),
        ("0.77", ["--mem-fraction-static 0.77 (as given)", "fewer than one request needs"]),
    ],
    ids=["upstream-default", "too-small"],
)
def test_a_kv_budget_that_cannot_hold_one_request_of_the_context_is_refused(fraction, fragments):
    """Issue 54: GLM-5.1-FP8's prefill (TP8 / CP8, chunk 65,536) on 8 x H200 with upstream's own --mem-fraction-static
    (0.258: it keeps 1.5 MB of activations per chunk token) leaves no KV budget at all: the dry-run refuses it, naming
    the flag and the launchers' variable; so does a fraction whose budget holds less than one request."""
    done = pd_dry_run({"PD_GPU_CAPABILITY": "9.0", "PD_PREFILL_MEM_FRACTION_STATIC": fraction}, "prefill")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "cannot hold one request of the context length (202,752 tokens)" in done.stderr, done.stderr
    assert "PD_PREFILL_MEM_FRACTION_STATIC" in done.stderr
    for fragment in fragments:
        assert fragment in done.stderr, done.stderr


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_env_files_in_either_format_and_line_ending_are_read_alike(tmp_path, newline):
    """An env file of `export` lines (shell syntax) and compose-style KEY=VALUE lines, LF or CRLF, gives the router
    the same command; a line of neither form is refused with its line number and without its text (it may hold a
    secret); the shipped file reads in CRLF too."""
    lines = [
        'export PD_ROUTER_PORT="${PD_ROUTER_PORT:-31005}"',
        "  # a comment, after blanks",
        "",
        "PD_ROUTER_HOST=0.0.0.0",
        "PD_ROUTER_EXTRA_ARGS='--decode-policy random'",
    ]
    env_file = tmp_path / "router.env"
    env_file.write_bytes(newline.join(lines).encode() + newline.encode())
    env = {**os.environ, "PD_PYTHON": sys.executable, "PD_ENV_FILE": str(env_file)}
    for name in ("PD_ROUTER_PORT", "PD_ROUTER_HOST", "PD_ROUTER_EXTRA_ARGS"):
        env.pop(name, None)
    done = subprocess.run([PD / "run_router.sh", "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--host 0.0.0.0 --port 31005 --decode-policy random" in done.stdout and "\r" not in done.stdout
    env_file.write_bytes(newline.join([*lines, "oops hf_secret_value"]).encode())
    bad = subprocess.run([PD / "run_router.sh", "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and f"{env_file}:6: not a KEY=VALUE or export KEY=VALUE line" in bad.stderr
    assert "hf_secret_value" not in bad.stdout + bad.stderr
    shipped = tmp_path / "shipped.env"
    shipped.write_bytes((PD / "glm51-fp8-b300.env").read_bytes().replace(b"\n", newline.encode()))
    ok = subprocess.run(
        [PD / "run_router.sh", "--dry-run"],
        env={**env, "PD_ENV_FILE": str(shipped)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0 and "\r" not in ok.stdout, ok.stderr


def test_dry_run_through_the_bash_launcher_scrubs_secrets_from_parser_errors():
    # The router role: the bash -> CLI -> PD_PYTHON check -> exit status path without an import of upstream.
    env = {**os.environ, "PD_PYTHON": sys.executable, "PD_ROUTER_EXTRA_ARGS": "--decode-polcy random --hf-token tk-3"}
    bad = subprocess.run([PD / "run_router.sh", "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2, bad.stderr
    assert "error: unrecognized arguments: --decode-polcy random --hf-token <redacted>" in bad.stderr
    assert bad.stdout.startswith("# router\n") and "-m sglang_router.launch_router --pd-disaggregation" in bad.stdout
    assert "tk-3" not in bad.stdout + bad.stderr


def test_dry_run_with_an_interpreter_without_sglang_says_what_is_needed(tmp_path):
    # The launcher's default PD_PYTHON is python3; one without sglang gets the fix, not a traceback.
    # `python -S` has no site-packages, hence no sglang; our package comes through PYTHONPATH.
    bare = tmp_path / "python-without-sglang"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    env = {**os.environ, "PD_PYTHON": str(bare), "PD_LAUNCH_PYTHON": sys.executable, "PYTHONPATH": str(REPO / "python")}
    ran = subprocess.run([PD / "run_prefill.sh", "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 2, ran.stderr
    assert f"prefill: PD_PYTHON={bare} cannot import sglang" in ran.stderr
    assert "PD_PYTHON must be the interpreter that serves" in ran.stderr and "Traceback" not in ran.stderr


# ---------------------------------------------------------------------------------- start-up checks


CP_SHARED_KV_LOCAL = {"PD_MODEL_PATH": str(DSA_MODEL), "PD_CP_SHARED_KV": "1"}
# (name, role, PD_* settings, status, a fragment of the message): each through the start-up checks the dry-run runs.
CHECKS = [
    (
        "misspelled flag",
        "prefill",
        {"PD_PREFILL_EXTRA_ARGS": "--attn-cp-sise 8"},
        "refused",
        "sglang serve: error: unrecognized arguments: --attn-cp-sise 8",
    ),
    # Upstream 0.5.23 split --cuda-graph-max-bs into -decode/-prefill; abbreviations are never accepted.
    (
        "abbreviated flag",
        "decode",
        {"PD_DECODE_EXTRA_ARGS": "--cuda-graph-max-bs 64"},
        "refused",
        "unrecognized arguments: --cuda-graph-max-bs 64",
    ),
    (
        "bad choice",
        "prefill",
        {"PD_CP_STRATEGY": "round-robin"},
        "refused",
        "argument --cp-strategy: invalid choice: 'round-robin'",
    ),
    (
        "misspelled router flag",
        "router",
        {"PD_ROUTER_EXTRA_ARGS": "--prefil-policy random"},
        "refused",
        "unrecognized arguments: --prefil-policy random",
    ),
    # The hub model's config.json is not on this machine: said, not silently skipped.
    (
        "flag of our queue, hub model",
        "prefill",
        {"PD_CP_SHARED_KV": "1"},
        "partial",
        "flags accepted by upstream's ServerArgs parser; start-up checks NOT run: no config.json of zai-org/GLM-5.1-FP8",
    ),
    (
        "local model, prefill",
        "prefill",
        CP_SHARED_KV_LOCAL,
        "ok",
        f"start-up checks passed (from {DSA_MODEL}/config.json, for a GPU of compute capability 10.3 ",
    ),
    ("local model, decode", "decode", CP_SHARED_KV_LOCAL, "ok", "start-up checks passed"),
    (
        "trtllm prefill",
        "prefill",
        {**CP_SHARED_KV_LOCAL, "PD_DSA_PREFILL_BACKEND": "trtllm"},
        "refused",
        "--enable-cp-shared-kv: supports --dsa-prefill-backend",
    ),
    (
        "nixl",
        "prefill",
        {**CP_SHARED_KV_LOCAL, "PD_TRANSFER_BACKEND": "nixl"},
        "refused",
        "--enable-cp-shared-kv: supports --disaggregation-transfer-backend",
    ),
    (
        "zigzag",
        "prefill",
        {**CP_SHARED_KV_LOCAL, "PD_CP_STRATEGY": "zigzag"},
        "refused",
        "does not support --cp-strategy zigzag",
    ),
    (
        "non-DSA model",
        "prefill",
        {**CP_SHARED_KV_LOCAL, "PD_MODEL_PATH": "<llama>"},
        "refused",
        "--enable-cp-shared-kv: requires a DSA model",
    ),
]


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """Every CHECKS case through the start-up checks, in one PD_PYTHON process (the upstream import dominates)."""
    llama = tmp_path_factory.mktemp("llama")
    (llama / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    requests = []
    for _, role, settings, _, _ in CHECKS:
        config = cfg(**{k: str(llama) if v == "<llama>" else v for k, v in settings.items()})
        argv = pd_launch.router_args(config) if role == "router" else pd_launch.server_args(role, config)
        requests.append({"role": role, "argv": argv, "env": pd_launch.role_env(role, config)})
    env = {k: v for k, v in os.environ.items() if k != pd_launch.ALL_CP_RANKS_TRANSFER_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_cpkv.pd_launch.startup_check"],
        input=json.dumps({"roles": requests, "gpu_capability": ""}),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(zip([c[0] for c in CHECKS], json.loads(proc.stdout)))


@pytest.mark.parametrize("name, role, settings, status, fragment", CHECKS, ids=[c[0] for c in CHECKS])
def test_start_up_checks(checked, name, role, settings, status, fragment):
    got = checked[name]
    assert got["role"] == role and got["status"] == status and fragment in got["message"], got


def test_the_dry_run_leaves_infiniband_devices_this_machine_lacks_to_the_role_s_machine(tmp_path, monkeypatch):
    """The shipped env file's RoCE devices on a machine without them (any CPU machine): the dry-run passes, printing
    the command with them and saying they were not checked; a machine holding some of them but not all is the
    role's own, misconfigured: upstream's check runs there and refuses."""
    import importlib

    dry_run_module = importlib.import_module("sglang_cpkv.pd_launch.dry_run")

    devices = "roce_vf_rail0,roce_vf_rail1"
    config = cfg(PD_MODEL_PATH=str(DSA_MODEL), PD_IB_DEVICE=devices)
    monkeypatch.setattr(dry_run_module, "IB_SYSFS", tmp_path / "no-infiniband")
    text = dry_run_text(config, roles=["prefill"])
    assert f"--disaggregation-ib-device {devices}" in text
    assert (
        f"# PD_IB_DEVICE: not checked here: this machine has none of roce_vf_rail0, roce_vf_rail1 under {tmp_path}"
        in text
    )
    assert "# prefill: flags accepted by upstream's ServerArgs parser; start-up checks passed" in text
    (tmp_path / "some" / "roce_vf_rail0").mkdir(parents=True)
    assert dry_run_module.missing_ib_devices(config, tmp_path / "some") == []


def test_a_refusal_reaches_the_user_with_the_servers_message_and_no_secret():
    config = cfg(**CP_SHARED_KV_LOCAL, PD_DSA_PREFILL_BACKEND="trtllm", **SECRETS)
    out = io.StringIO()
    with pytest.raises(pd_launch.PDLaunchError) as err:
        pd_launch.dry_run(["prefill"], config, out=out)
    message = str(err.value)
    assert message.startswith("prefill: the server refuses this at start-up: ValueError: --enable-cp-shared-kv: ")
    assert "supports --dsa-prefill-backend" in message and "got 'trtllm'" in message
    assert out.getvalue().startswith("# prefill\n") and "--api-key '<redacted>'" in out.getvalue()
    assert not any(secret in message + out.getvalue() for secret in SECRET_VALUES)


def test_redaction_covers_both_flag_forms_and_argument_variables():
    secret_flags = ["--api-key", "--admin-api-key", "--hf-key", "--hf-token", "--authtoken", "--db-password"]
    secret_flags += ["--ssl-keyfile-password", "--control-plane-api-keys", "--postgres-db-url"]
    plain_flags = ["--max-new-tokens", "--tokenizer-path", "--skip-tokenizer-init", "--tp-size", "--keyword"]
    assert all(map(is_secret_flag, secret_flags)) and not any(map(is_secret_flag, plain_flags))
    argv = ["--api-key", "a1", "--client-secret=b2", "--skip-tokenizer-init", "--tp", "8", "--hf-token", "--x"]
    assert redact_argv(argv) == [
        "--api-key",
        REDACTED,
        f"--client-secret={REDACTED}",
        "--skip-tokenizer-init",
        "--tp",
        "8",
        "--hf-token",  # no value follows: nothing to hide, and --x is not eaten
        "--x",
    ]
    assert redact_env_value("PD_DECODE_EXTRA_ARGS", "--api-key a1 --tp 8") == f"--api-key '{REDACTED}' --tp 8"
    assert redact_env_value("HF_TOKEN", "hf_x") == REDACTED
    # Several values after one flag (the router's --control-plane-api-keys ID:ROLE:KEY ...), and its `keys`.
    router = ["--control-plane-api-keys", "a:admin:k-1", "b:user:k-2", "--host", "h", "--redis-url", "redis://u:p@h"]
    assert redact_argv(router) == [
        "--control-plane-api-keys",
        REDACTED,
        REDACTED,
        "--host",
        "h",
        "--redis-url",
        REDACTED,
    ]
    # and a URL's credentials, as values too (scrubbed from free text wherever they appear)
    assert secret_values(router) == ["a:admin:k-1", "b:user:k-2", "redis://u:p@h", "u:p", "p"]
    # Any URL's credentials, in any variable, argument or free text (issue 54: SGLANG_CPKV_INDEX_URL in the header).
    assert redact_env_value("SGLANG_CPKV_INDEX_URL", "https://u:pw-1@h:8/s?x=1") == "https://<redacted>@h:8/s?x=1"
    assert redact_argv(["--prefill", "http://tok@h:1", "--tp", "8"]) == [
        "--prefill",
        "http://<redacted>@h:1",
        "--tp",
        "8",
    ]
    assert scrub("see 'https://a:b@c@h/p' and ftp://h/x@y", []) == "see 'https://<redacted>@h/p' and ftp://h/x@y"
    env = {
        "HF_TOKEN": "hf_abcdef",
        "SGLANG_API_KEY": "k-3-long",
        "PD_MAX_TOKENS": "4096",
        "PD_DECODE_EXTRA_ARGS": "--api-key k-4-long",
    }
    assert sorted(secret_values([], env)) == ["hf_abcdef", "k-3-long", "k-4-long"]  # not MAX_TOKENS' 4096
    # Free text and a stream cut anywhere: the value as written and as repr/JSON quote it.
    secret = "s3cr\\et-\u00e9x"  # repr doubles the backslash, JSON also escapes the e-acute
    text = f"api_key={secret!r} {json.dumps({'k': secret})} plain {secret} short 1"
    assert scrub(text, [secret, "1"]) == f'api_key=\'{REDACTED}\' {{"k": "{REDACTED}"}} plain {REDACTED} short 1'
    for cut in range(len(text)):
        scrubber = StreamScrubber([secret])
        streamed = scrubber.feed(text[:cut].encode()) + scrubber.feed(text[cut:].encode() + b"\n") + scrubber.flush()
        assert streamed.decode() == scrub(text, [secret]) + "\n"
    long_line = StreamScrubber(["abcdef"])
    assert long_line.feed(b"x" * (StreamScrubber.MAX_PENDING + 10) + b"abc") == b"x" * (StreamScrubber.MAX_PENDING + 8)
    assert long_line.feed(b"def\n") == b"xx" + REDACTED.encode() + b"\n"


def test_documented_env_file_sets_only_settings_the_launcher_reads():
    # A misspelled PD_* variable would be ignored silently on the cluster.
    shown = (
        subprocess.run(
            ["bash", "-c", f". {PD / 'glm51-fp8-b300.env'} && env -0"],
            capture_output=True,
            timeout=30,
            env={"PATH": os.environ["PATH"]},
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    env = dict(item.split("=", 1) for item in shown if "=" in item)
    pd_vars = {k for k in env if k.startswith("PD_")}
    assert pd_vars and pd_vars <= set(pd_launch.ENV_DEFAULTS) | {"PD_PYTHON", "PD_LAUNCH_PYTHON", "PD_ENV_FILE"}, (
        sorted(pd_vars - set(pd_launch.ENV_DEFAULTS))
    )
    config = pd_launch.PDConfig.from_env(env)
    assert (config.prefill_tp, config.prefill_cp, config.decode_tp, config.decode_dp) == (8, 8, 8, 8)
    assert env["NCCL_IB_HCA"].count("roce_vf_rail") == 8


# ---------------------------------------------------------------------------------- lifecycle


@pytest.fixture
def stub_env(tmp_path):
    stub = write_stub_python(tmp_path)  # PD_PYTHON: the launchers run it as they would the serving interpreter
    env = {
        **os.environ,
        "PD_LAUNCH_PYTHON": sys.executable,
        "PD_PYTHON": str(stub),
        "PD_LOG_DIR": str(tmp_path / "logs"),
        "PD_PREFILL_HOST": "127.0.0.1",
        "PD_PREFILL_PORT": str(free_port()),
        "PD_HEALTH_TIMEOUT": "30",
        "PD_STOP_TIMEOUT": "5",
        "STUB_CHILD_PID_FILE": str(tmp_path / "child.pid"),
        # The GPUs the launchers count on this host, whatever the machine has (CUDA_VISIBLE_DEVICES, else nvidia-smi).
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(16)),
        "NCCL_IB_HCA": "mlx5_0,mlx5_1",
        "SGLANG_API_KEY": "do-not-log-me",
        **SECRETS,
    }
    yield env
    subprocess.run([PD / "stop.sh"], env=env, capture_output=True, timeout=60)


def no_secret_in(*texts: str) -> bool:
    return not any(secret in text for text in texts for secret in (*SECRET_VALUES, "do-not-log-me"))


def launch(*args, env):
    return subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=120)


def test_start_health_wait_status_and_stop_end_exactly_the_started_group(stub_env, tmp_path):
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    try:
        started = launch(PD / "run_prefill.sh", env=stub_env)
        assert started.returncode == 0, started.stderr
        assert "prefill is healthy" in started.stderr
        pid_file, log_file = tmp_path / "logs" / "prefill.pid", (tmp_path / "logs" / "prefill.log").resolve()
        record = json.loads(pid_file.read_text())
        child = int((tmp_path / "child.pid").read_text())
        assert alive(record["pid"]) and alive(child)
        log = log_file.read_text()
        assert "# command: " in log and "--disaggregation-mode prefill" in log and "stub server starting" in log
        assert "# env NCCL_IB_HCA=mlx5_0,mlx5_1" in log
        assert "--api-key '<redacted>' '--admin-api-key=<redacted>'" in log and "--api-key" in record["argv"]
        assert no_secret_in(log, pid_file.read_text(), started.stdout, started.stderr)
        assert stat.S_IMODE(pid_file.stat().st_mode) == 0o600 and stat.S_IMODE(log_file.stat().st_mode) == 0o640

        assert launch(PD / "run_prefill.sh", "status", env=stub_env).returncode == 0
        again = launch(PD / "run_prefill.sh", env=stub_env)
        assert again.returncode == 2 and "already runs" in again.stderr

        stopped = launch(PD / "stop.sh", env=stub_env)
        assert stopped.returncode == 0, stopped.stderr
        deadline = time.monotonic() + 10
        while (alive(record["pid"]) or alive(child)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(record["pid"]) and not alive(child)
        assert not (tmp_path / "logs" / "prefill.pid").exists()
        assert alive(decoy.pid)
    finally:
        decoy.kill()
        decoy.wait()


def test_up_starts_all_three_roles_in_order_and_stop_ends_them(stub_env, tmp_path):
    env = {
        **stub_env,
        "PD_DECODE_HOST": "127.0.0.1",
        "PD_DECODE_PORT": str(free_port()),
        "PD_ROUTER_HOST": "127.0.0.1",
        "PD_ROUTER_PORT": str(free_port()),
    }
    up = launch(PD / "up.sh", env=env)
    assert up.returncode == 0, up.stderr
    assert [line for line in up.stderr.splitlines() if "is healthy" in line] == [
        f"[pd_launch] {r} is healthy" for r in pd_launch.ROLES
    ]
    records = {r: json.loads((tmp_path / "logs" / f"{r}.pid").read_text()) for r in pd_launch.ROLES}
    assert "-m sglang_router.launch_router --pd-disaggregation" in " ".join(records["router"]["argv"])
    assert launch(PD / "stop.sh", env=env).returncode == 0
    deadline = time.monotonic() + 10
    while any(alive(rec["pid"]) for rec in records.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(rec["pid"]) for rec in records.values())
    assert not list((tmp_path / "logs").glob("*.pid"))


def test_stop_leaves_a_recycled_pid_alone(stub_env, tmp_path):
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    try:
        (tmp_path / "logs").mkdir()
        stale = {"role": "prefill", "pid": decoy.pid, "pgid": decoy.pid, "start_time": 1, "argv": [], "log": ""}
        (tmp_path / "logs" / "prefill.pid").write_text(json.dumps(stale))
        stopped = launch(PD / "run_prefill.sh", "stop", env=stub_env)
        assert stopped.returncode == 0 and "already gone" in stopped.stderr
        assert alive(decoy.pid)
    finally:
        decoy.kill()
        decoy.wait()


def test_a_record_of_another_boot_naming_a_strangers_group_is_not_acted_on(stub_env, tmp_path):
    """After a reboot a record's group id can be another program's, whose own leader has exited (its members live
    on): `stop` must not signal that group nor report "stopped", and `start` must not take the role for running. The
    record says which boot wrote it."""
    code = "import os, sys, time; os.setsid(); print(os.getpid(), flush=True); os.fork() or time.sleep(300)"
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pgid = int(leader.stdout.readline())
    leader.wait()  # the stranger's leader exits; its forked child lives on in group pgid
    members = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _pgrp(int(p.name)) == pgid]
    assert members and pgid not in members
    try:
        (tmp_path / "logs").mkdir()
        stale = {
            "role": "prefill",
            "pid": pgid,
            "pgid": pgid,
            "start_time": 1,
            "boot_id": "00000000-0000-0000-0000-000000000000",
            "argv": [],
            "log": "",
        }
        (tmp_path / "logs" / "prefill.pid").write_text(json.dumps(stale))
        stopped = launch(PD / "run_prefill.sh", "stop", env=stub_env)
        assert stopped.returncode == 0 and "already gone" in stopped.stderr and "stopped" not in stopped.stderr
        assert all(alive(pid) for pid in members)
        started = launch(PD / "run_prefill.sh", env={**stub_env, "STUB_MODE": "exit", "PD_HEALTH_TIMEOUT": "60"})
        assert "already runs" not in started.stderr
    finally:
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _pgrp(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


@pytest.mark.parametrize("mode, message", [("exit", "exited before it became healthy"), ("hang", "PD_HEALTH_TIMEOUT")])
def test_failed_start_is_reported_and_cleaned_up(stub_env, tmp_path, mode, message):
    # A stub that exits is seen exiting whatever the timeout: a generous one keeps a loaded CI box from timing out
    # first. A hanging stub is waited for the whole timeout, which must still cover its start-up (its first log
    # line and child are asserted below; an interpreter start can take seconds on a loaded box).
    env = {**stub_env, "STUB_MODE": mode, "PD_HEALTH_TIMEOUT": "60" if mode == "exit" else "10"}
    failed = launch(PD / "run_prefill.sh", env=env)
    assert failed.returncode == 2 and message in failed.stderr
    assert "stub server starting" in failed.stderr  # the log tail is shown
    if mode == "hang":  # the wait said what it saw while it waited
        assert re.search(r"still waiting for prefill \(\d+s of 10s\): pid \d+ running, not listening", failed.stderr)
    assert not alive(int((tmp_path / "child.pid").read_text()))
    assert not (tmp_path / "logs" / "prefill.pid").exists()


@pytest.mark.parametrize("script", ["run_prefill.sh", "up.sh"])
def test_ctrl_c_while_starting_stops_what_started_and_exits_cleanly(stub_env, tmp_path, script):
    """Ctrl-C while a role is starting (a stub that never becomes healthy): no traceback, exit status 130, and what
    had started is stopped: its processes gone and no pid record left (up: every role)."""
    env = {**stub_env, "STUB_MODE": "hang", "PD_HEALTH_TIMEOUT": "120"}
    # As a terminal's Ctrl-C finds it: SIGINT not ignored (a test runner started in the background ignores it, and
    # Python keeps an inherited ignore).
    proc = subprocess.Popen(
        [PD / script],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        child = tmp_path / "child.pid"
        assert wait_for(lambda: child.exists() and child.read_text().strip()), "the stub never started"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "interrupted while prefill was starting; prefill stopped" in err
    assert not alive(int(child.read_text()))
    assert not list((tmp_path / "logs").glob("*.pid"))


def test_foreground_run_tees_output_and_returns_the_role_exit_status(stub_env, tmp_path):
    ran = launch(PD / "run_prefill.sh", "--foreground", env={**stub_env, "STUB_MODE": "exit"})
    assert ran.returncode == 3
    assert "stub server starting" in ran.stdout
    log = (tmp_path / "logs" / "prefill.log").read_text()
    assert "stub server starting" in log and no_secret_in(log, ran.stdout, ran.stderr)
    assert not alive(int((tmp_path / "child.pid").read_text()))  # the group is ended with its main process


def test_stop_from_another_directory_finds_the_records(stub_env, tmp_path):
    # PD_LOG_DIR unset: the default record location does not depend on the directory the launcher ran in.
    env = {k: v for k, v in stub_env.items() if k != "PD_LOG_DIR"}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    (tmp_path / "here").mkdir()
    (tmp_path / "elsewhere").mkdir()
    started = subprocess.run(
        [PD / "run_prefill.sh"], env=env, cwd=tmp_path / "here", capture_output=True, text=True, timeout=120
    )
    assert started.returncode == 0, started.stderr
    record_file = tmp_path / "state" / "sglang-cpkv" / "pd-logs" / "prefill.pid"
    leader = json.loads(record_file.read_text())["pid"]
    stopped = subprocess.run(
        [PD / "stop.sh"], env=env, cwd=tmp_path / "elsewhere", capture_output=True, text=True, timeout=120
    )
    assert stopped.returncode == 0, stopped.stderr
    assert "prefill: stopped" in stopped.stderr and not record_file.exists()
    assert wait_for(lambda: not alive(leader))


def test_background_server_ignoring_sigterm_is_killed_after_the_stop_timeout(stub_env, tmp_path):
    env = {**stub_env, "STUB_MODE": "ignore-term", "PD_STOP_TIMEOUT": "2"}
    assert launch(PD / "run_prefill.sh", env=env).returncode == 0
    leader = json.loads((tmp_path / "logs" / "prefill.pid").read_text())["pid"]
    begun = time.monotonic()
    stopped = launch(PD / "stop.sh", "prefill", env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert "still alive after SIGTERM + 2s" in stopped.stderr and time.monotonic() - begun >= 2
    assert wait_for(lambda: not alive(leader))


def test_foreground_server_ignoring_sigterm_is_killed_after_the_stop_timeout(stub_env, tmp_path):
    env = {**stub_env, "STUB_MODE": "ignore-term", "PD_STOP_TIMEOUT": "2"}
    proc = subprocess.Popen(
        [PD / "run_prefill.sh", "--foreground"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        port = int(env["PD_PREFILL_PORT"])
        assert wait_for(lambda: listening(port)), "the stub never listened"
        child = int((tmp_path / "child.pid").read_text())  # the stub's child: it must end with the group
        begun = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # what `docker stop` sends the container's main process
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert time.monotonic() - begun >= 2, err
    assert "still running 2s after the stop signal (PD_STOP_TIMEOUT); SIGKILL" in err
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert not alive(child)
    assert no_secret_in(out, err)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
