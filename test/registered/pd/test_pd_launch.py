"""The P/D launchers: commands checked by upstream's own parsers (CPU), and the process lifecycle.

The dry-run tests build the default GLM-5.1-FP8 CP8 deployment and feed it to upstream's ServerArgs parser
and sglang_router's parser; a misspelled, abbreviated or ill-chosen flag must fail with their own argparse
error. The lifecycle tests start a stub "server" (a script standing in for PD_PYTHON) through the real
bash launchers, and check the health wait, the pid record and that `stop` ends exactly the process group
it started.
"""

import argparse
import io
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sglang_cpkv.pd_launch import (
    ALL_CP_RANKS_TRANSFER_ENV,
    CP_SHARED_KV_FLAG,
    ENV_DEFAULTS,
    ROLES,
    PDConfig,
    PDLaunchError,
    build_command,
    dry_run,
    role_env,
    shell_command,
)
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=45, suite="cpkv-cpu")

REPO = Path(__file__).resolve().parents[3]
PD = REPO / "scripts" / "pd"


def cfg(**env) -> PDConfig:
    return PDConfig.from_env(env)


def dry_run_text(config: PDConfig, roles=ROLES) -> str:
    out = io.StringIO()
    dry_run(roles, config, out=out)
    return out.getvalue()


# ---------------------------------------------------------------------------------- dry-run


def test_default_deployment_is_accepted_by_upstream_parsers():
    text = dry_run_text(cfg())
    prefill = build_command("prefill", cfg())
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
    assert CP_SHARED_KV_FLAG not in prefill  # opt-in only
    assert "--attn-cp-size" not in build_command("decode", cfg())  # upstream refuses CP on decode
    for role in ("prefill", "decode"):
        assert f"# {role}: flags accepted by upstream's ServerArgs parser" in text
    assert "# router: flags accepted by sglang_router's parser" in text  # sglang-router is in dev-cpu.txt


def test_misspelled_flag_fails_with_upstreams_own_error():
    with pytest.raises(PDLaunchError) as err:
        dry_run_text(cfg(PD_PREFILL_EXTRA_ARGS="--attn-cp-sise 8"), ["prefill"])
    assert "sglang serve: error: unrecognized arguments: --attn-cp-sise 8" in str(err.value)


def test_abbreviated_flag_is_refused():
    # Upstream 0.5.23 split --cuda-graph-max-bs into -decode/-prefill; abbreviations are never accepted.
    with pytest.raises(PDLaunchError, match="unrecognized arguments: --cuda-graph-max-bs 64"):
        dry_run_text(cfg(PD_DECODE_EXTRA_ARGS="--cuda-graph-max-bs 64"), ["decode"])


def test_bad_choice_fails_with_upstreams_own_error():
    with pytest.raises(PDLaunchError, match=r"argument --cp-strategy: invalid choice: 'round-robin'"):
        dry_run_text(cfg(PD_CP_STRATEGY="round-robin"), ["prefill"])


def test_misspelled_router_flag_fails_with_router_parser_error():
    with pytest.raises(PDLaunchError, match="unrecognized arguments: --prefil-policy random"):
        dry_run_text(cfg(PD_ROUTER_EXTRA_ARGS="--prefil-policy random"), ["router"])


def test_cp_shared_kv_flag_is_opt_in_and_checked_against_the_installed_upstream():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    patched = CP_SHARED_KV_FLAG in parser._option_string_actions
    config = cfg(PD_CP_SHARED_KV="1")
    assert CP_SHARED_KV_FLAG in build_command("prefill", config)
    assert CP_SHARED_KV_FLAG not in build_command("decode", config)
    # Owner-sharded pages: decode must pull from every prefill CP rank, and both sides read the switch.
    for role in ("prefill", "decode"):
        assert role_env(role, config) == {ALL_CP_RANKS_TRANSFER_ENV: "1"}
        assert shell_command(role, config).startswith(f"{ALL_CP_RANKS_TRANSFER_ENV}=1 ")
    assert role_env("router", config) == {} and role_env("prefill", cfg()) == {}
    with pytest.raises(PDLaunchError, match=f"{ALL_CP_RANKS_TRANSFER_ENV}=1 on prefill and decode"):
        cfg(PD_CP_SHARED_KV="1", **{ALL_CP_RANKS_TRANSFER_ENV: "0"})
    if patched:
        assert "# prefill: flags accepted" in dry_run_text(config, ["prefill"])
    else:
        with pytest.raises(PDLaunchError, match=r"sglang_cpkv\.overlay apply"):
            dry_run_text(config, ["prefill"])


@pytest.mark.parametrize(
    "env, message",
    [
        ({"PD_PREFILL_TP": "6"}, "PD_PREFILL_TP=6 must be divisible by PD_PREFILL_DP * PD_PREFILL_CP"),
        ({"PD_DECODE_PORT": "30o01"}, "PD_DECODE_PORT='30o01' is not an integer"),
        ({"PD_CP_SHARED_KV": "maybe"}, "PD_CP_SHARED_KV='maybe' must be 0 or 1"),
        ({"PD_PREFILL_EXTRA_ARGS": "--x 'unterminated"}, "PD_PREFILL_EXTRA_ARGS: cannot split"),
    ],
)
def test_bad_environment_names_the_variable(env, message):
    with pytest.raises(PDLaunchError, match=re.escape(message)):
        cfg(**env)


def test_dry_run_through_the_bash_launcher():
    # The router role: the bash -> CLI -> exit status path without a second (slow) import of upstream.
    env = {**os.environ, "PD_LAUNCH_PYTHON": sys.executable, "PD_ROUTER_EXTRA_ARGS": "--decode-polcy random"}
    bad = subprocess.run([PD / "run_router.sh", "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2, bad.stderr
    assert "error: unrecognized arguments: --decode-polcy random" in bad.stderr
    assert bad.stdout.startswith("# router\n") and "-m sglang_router.launch_router --pd-disaggregation" in bad.stdout


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
    assert pd_vars and pd_vars <= set(ENV_DEFAULTS) | {"PD_PYTHON", "PD_LAUNCH_PYTHON", "PD_ENV_FILE"}, sorted(
        pd_vars - set(ENV_DEFAULTS)
    )
    config = PDConfig.from_env(env)
    assert (config.prefill_tp, config.prefill_cp, config.decode_tp, config.decode_dp) == (8, 8, 8, 8)
    assert env["NCCL_IB_HCA"].count("roce_vf_rail") == 8


# ---------------------------------------------------------------------------------- lifecycle

STUB = textwrap.dedent(
    """\
    # Stands in for `python -m sglang.launch_server ...`: serves /health on --port unless told not to,
    # and spawns a child so that the test can see the whole process group end.
    import http.server, os, subprocess, sys, time
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(os.environ["STUB_CHILD_PID_FILE"], "w") as f:
        f.write(str(child.pid))
    print("stub server starting on", port, flush=True)
    mode = os.environ.get("STUB_MODE", "serve")
    if mode == "exit":
        sys.exit(3)
    if mode == "hang":
        time.sleep(300)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def stub_env(tmp_path):
    stub = tmp_path / "stub_python"
    stub.write_text(f"#!{sys.executable}\n" + STUB)
    stub.chmod(0o755)
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
        "NCCL_IB_HCA": "mlx5_0,mlx5_1",
        "SGLANG_API_KEY": "do-not-log-me",
    }
    yield env
    subprocess.run([PD / "stop.sh"], env=env, capture_output=True, timeout=60)


def launch(*args, env):
    return subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=120)


def test_start_health_wait_status_and_stop_end_exactly_the_started_group(stub_env, tmp_path):
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    try:
        started = launch(PD / "run_prefill.sh", env=stub_env)
        assert started.returncode == 0, started.stderr
        assert "prefill is healthy" in started.stderr
        record = json.loads((tmp_path / "logs" / "prefill.pid").read_text())
        child = int((tmp_path / "child.pid").read_text())
        assert alive(record["pid"]) and alive(child)
        log = (tmp_path / "logs" / "prefill.log").read_text()
        assert "# command: " in log and "--disaggregation-mode prefill" in log and "stub server starting" in log
        assert "# env NCCL_IB_HCA=mlx5_0,mlx5_1" in log and "do-not-log-me" not in log

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
        f"[pd_launch] {r} is healthy" for r in ROLES
    ]
    records = {r: json.loads((tmp_path / "logs" / f"{r}.pid").read_text()) for r in ROLES}
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


@pytest.mark.parametrize("mode, message", [("exit", "exited before it became healthy"), ("hang", "PD_HEALTH_TIMEOUT")])
def test_failed_start_is_reported_and_cleaned_up(stub_env, tmp_path, mode, message):
    env = {**stub_env, "STUB_MODE": mode, "PD_HEALTH_TIMEOUT": "3"}
    failed = launch(PD / "run_prefill.sh", env=env)
    assert failed.returncode == 2 and message in failed.stderr
    assert "stub server starting" in failed.stderr  # the log tail is shown
    assert not alive(int((tmp_path / "child.pid").read_text()))
    assert not (tmp_path / "logs" / "prefill.pid").exists()


def test_foreground_run_tees_output_and_returns_the_role_exit_status(stub_env, tmp_path):
    ran = launch(PD / "run_prefill.sh", "--foreground", env={**stub_env, "STUB_MODE": "exit"})
    assert ran.returncode == 3
    assert "stub server starting" in ran.stdout
    assert "stub server starting" in (tmp_path / "logs" / "prefill.log").read_text()
    assert not alive(int((tmp_path / "child.pid").read_text()))  # the group is ended with its main process


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
