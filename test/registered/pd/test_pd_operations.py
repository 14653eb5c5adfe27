"""The launchers as an operator runs them, against the failures an operator meets (issue 23).

Stub servers (sglang_cpkv.testing.pd_stub, as PD_PYTHON) go through the real bash launchers: a port
another server holds, a role that died while something else answers on its port, secrets in the
server's own output, a log that cannot be written (``ulimit -f``: writes fail with EFBIG, as on a full
disk), log rotation, a dropped terminal (SIGHUP), a foreground role stopped by ``stop.sh``, GPU ranges
that overlap on one host, and typos the CLI must refuse by name.
"""

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.pd_stub import alive, free_port, listening, wait_for, write_stub_python

register_cpu_ci(est_time=25, suite="cpkv-cpu")

REPO = Path(__file__).resolve().parents[3]
PD = REPO / "scripts" / "pd"
# Every secret the operator may give, each way the launchers take it; none may reach any output.
SECRET_ENV = {
    "PD_PREFILL_EXTRA_ARGS": "--api-key sk-api-111 --admin-api-key=sk-admin-222 --ssl-keyfile-password sk-pass-333",
    "PD_ROUTER_EXTRA_ARGS": "--control-plane-api-keys cp1:admin:sk-cp-444 cp2:user:sk-cp-555",
    "HF_TOKEN": "hf_sk666token",
    # A URL-valued variable with a credential (issue 54: the log header printed it whole).
    "SGLANG_CPKV_INDEX_URL": "https://alice:sk-idx-777@index.example/simple/",
}
SECRETS = ("sk-api-111", "sk-admin-222", "sk-pass-333", "sk-cp-444", "sk-cp-555", "hf_sk666token", "sk-idx-777")
# The GPUs the launchers see on this host, whatever the machine has: they count CUDA_VISIBLE_DEVICES when it is set
# (else nvidia-smi's list). 16, so that a test may place the decode after an 8-GPU prefill.
SIXTEEN_GPUS = ",".join(str(i) for i in range(16))


def leaked(*texts: str) -> list[str]:
    return [secret for secret in SECRETS if any(secret in text for text in texts)]


@pytest.fixture
def env(tmp_path):
    env = {
        **os.environ,
        "PD_LAUNCH_PYTHON": sys.executable,
        "PD_PYTHON": str(write_stub_python(tmp_path)),
        "PD_LOG_DIR": str(tmp_path / "logs"),
        "PD_PREFILL_HOST": "127.0.0.1",
        "PD_PREFILL_PORT": str(free_port()),
        "PD_DECODE_HOST": "127.0.0.1",
        "PD_DECODE_PORT": str(free_port()),
        "PD_BOOTSTRAP_PORT": str(free_port()),
        "PD_ROUTER_HOST": "127.0.0.1",
        "PD_ROUTER_PORT": str(free_port()),
        "PD_HEALTH_TIMEOUT": "60",
        "PD_STOP_TIMEOUT": "5",
        "STUB_CHILD_PID_FILE": str(tmp_path / "child.pid"),
        "CUDA_VISIBLE_DEVICES": SIXTEEN_GPUS,
        **SECRET_ENV,
    }
    yield env
    subprocess.run([PD / "stop.sh"], env=env, capture_output=True, timeout=120)


def launch(*args, env, timeout=120):
    return subprocess.run([str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout)


def record(tmp_path, role="prefill") -> dict:
    return json.loads((tmp_path / "logs" / f"{role}.pid").read_text())


class ForeignHealth:
    """Another program's HTTP server on a port: it answers /health with 200 (the issue's port collision)."""

    def __init__(self, port: int):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------------------------- health is ours


def test_a_port_another_server_holds_is_refused_not_reported_healthy(env, tmp_path):
    foreign = ForeignHealth(int(env["PD_PREFILL_PORT"]))
    try:
        started = launch(PD / "run_prefill.sh", env=env)
        assert started.returncode == 2, started.stderr
        assert f"PD_PREFILL_PORT={env['PD_PREFILL_PORT']}: cannot listen on 127.0.0.1" in started.stderr
        assert "is healthy" not in started.stderr and not (tmp_path / "logs" / "prefill.pid").exists()
    finally:
        foreign.close()


def test_status_checks_that_our_process_is_alive_and_holds_the_port(env, tmp_path):
    # Our role alive but not listening while another server answers on its port: not healthy.
    hanging = {**env, "STUB_MODE": "hang"}
    assert launch(PD / "run_prefill.sh", "--no-wait", env=hanging).returncode == 0
    assert wait_for(lambda: (tmp_path / "logs" / "prefill.pid").exists())
    foreign = ForeignHealth(int(env["PD_PREFILL_PORT"]))
    try:
        seen = launch(PD / "run_prefill.sh", "status", env=env)
        assert (
            seen.returncode == 1
            and "not listening on port" in seen.stdout
            and "(another process listens there), not healthy" in seen.stdout
        ), seen.stdout
        # Our role dead, the other server still answering: "gone", not "healthy".
        server = record(tmp_path)
        os.killpg(server["pgid"], signal.SIGKILL)
        assert wait_for(lambda: not alive(server["pid"]))
        seen = launch(PD / "run_prefill.sh", "status", env=env)
        assert seen.returncode == 1 and ", not healthy (" in seen.stdout, seen.stdout
    finally:
        foreign.close()


def test_router_health_needs_both_workers(env, tmp_path):
    env["PD_DECODE_BASE_GPU_ID"] = "8"  # on this host, beside the prefill's GPUs 0-7
    for role in ("prefill", "decode", "router"):
        started = launch(PD / f"run_{role}.sh", env=env)
        assert started.returncode == 0, started.stderr
    assert launch(PD / "run_router.sh", "status", env=env).returncode == 0
    assert launch(PD / "stop.sh", "prefill", env=env).returncode == 0
    seen = launch(PD / "run_router.sh", "status", env=env)
    assert seen.returncode == 1, seen.stdout
    assert f"its worker http://127.0.0.1:{env['PD_PREFILL_PORT']}/health does not answer 200" in seen.stdout


# ---------------------------------------------------------------------------------- secrets


def test_the_servers_own_output_is_scrubbed_in_the_log_stdout_and_the_failure_tail(env, tmp_path):
    started = launch(PD / "run_prefill.sh", env=env)
    assert started.returncode == 0, started.stderr
    background_log = (tmp_path / "logs" / "prefill.log").read_text()
    assert "server_args=ServerArgs(" in background_log and "<redacted>" in background_log
    assert launch(PD / "stop.sh", env=env).returncode == 0

    failed = launch(PD / "run_prefill.sh", env={**env, "STUB_MODE": "exit"})
    assert failed.returncode == 2 and "server_args=ServerArgs(" in failed.stderr  # the tail is shown, scrubbed

    foreground = launch(PD / "run_router.sh", "--foreground", env={**env, "STUB_MODE": "exit"})  # `docker logs`
    assert foreground.returncode == 3 and "server_args=ServerArgs(" in foreground.stdout
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log*"))
    pid_dir = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.pid"))
    texts = (background_log, logs, pid_dir, started.stderr, failed.stdout, failed.stderr)
    assert not leaked(*texts, foreground.stdout, foreground.stderr), leaked(*texts, foreground.stdout)


def test_a_urls_credentials_are_redacted_in_the_header_the_command_the_record_and_the_output(env, tmp_path):
    """Issue 54: the log header printed SGLANG_CPKV_INDEX_URL with its password. Any URL with ``user:password@``, in
    a variable or an argument, shows ``<redacted>`` in place of its credentials everywhere the launchers write it."""
    urls = {**env, "PD_DECODE_EXTRA_ARGS": "--tokenizer-path https://carol:sk-arg-999@hub.example/tok"}
    started = launch(PD / "run_decode.sh", env=urls)
    assert started.returncode == 0, started.stderr
    log = (tmp_path / "logs" / "decode.log").read_text()
    assert "# env SGLANG_CPKV_INDEX_URL=https://<redacted>@index.example/simple/" in log
    shown = "--tokenizer-path 'https://<redacted>@hub.example/tok'"
    assert f"# env PD_DECODE_EXTRA_ARGS={shown}" in log and f"--attn-dp-size 8 {shown}" in log  # and the command
    printed = launch(PD / "pd.sh", "print", "decode", env=urls)
    assert printed.returncode == 0 and shown in printed.stdout
    pid_record = (tmp_path / "logs" / "decode.pid").read_text()
    assert launch(PD / "stop.sh", env=urls).returncode == 0
    texts = (log, pid_record, printed.stdout, started.stdout, started.stderr)
    assert not leaked(*texts) and not any("sk-arg-999" in text for text in texts)


# ---------------------------------------------------------------------------------- logs


def test_a_log_that_cannot_be_written_never_stalls_the_server(env, tmp_path):
    # ulimit -f: writes past 256 KiB fail (EFBIG), as on a full disk. The server writes 8 MiB and must finish.
    flood = {**env, "STUB_MODE": "flood", "STUB_FLOOD_BYTES": str(8 << 20)}
    ran = launch("bash", "-c", f"ulimit -f 256 && exec {PD / 'run_prefill.sh'} --foreground", env=flood, timeout=180)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.count("x" * 1023) == (8 << 20) // 1024  # stdout (`docker logs`) got all of it
    assert ran.stderr.count("failed (EFBIG") == 1, ran.stderr[-2000:]  # warned once
    log = (tmp_path / "logs" / "prefill.log").resolve()
    assert log.stat().st_size <= 256 * 1024


def test_logs_rotate_by_size_and_old_launch_logs_are_pruned(env, tmp_path):
    settings = {**env, "PD_LOG_MAX_BYTES": "64K", "PD_LOG_KEEP": "2"}
    flood = {**settings, "STUB_MODE": "flood", "STUB_FLOOD_BYTES": str(1 << 20)}
    assert launch(PD / "run_prefill.sh", "--foreground", env=flood).returncode == 0
    log = (tmp_path / "logs" / "prefill.log").resolve()
    rotated = sorted(p.name for p in log.parent.glob(log.name + ".*"))
    assert rotated == [log.name + ".1", log.name + ".2"], rotated
    for path in [log, *log.parent.glob(log.name + ".*")]:
        assert path.stat().st_size <= 64 * 1024 + 64 * 1024  # the limit, plus at most one read's worth
    for _ in range(2):
        assert launch(PD / "run_prefill.sh", "--foreground", env={**settings, "STUB_MODE": "exit"}).returncode == 3
    launches = sorted(p.name for p in (tmp_path / "logs").glob("prefill-*.log"))
    assert len(launches) == 2 and log.name not in launches, launches


def test_an_uncreatable_log_dir_is_refused_by_name(env, tmp_path):
    (tmp_path / "a-file").write_text("")
    bad = {**env, "PD_LOG_DIR": str(tmp_path / "a-file" / "logs")}
    for args in (["run_prefill.sh"], ["run_prefill.sh", "--foreground"]):
        ran = launch(PD / args[0], *args[1:], env=bad)
        assert ran.returncode == 2 and f"PD_LOG_DIR={tmp_path / 'a-file' / 'logs'}: cannot create it" in ran.stderr
        assert "Traceback" not in ran.stderr


# ---------------------------------------------------------------------------------- foreground


def test_sighup_ends_a_foreground_role_and_stop_finds_a_foreground_role(env, tmp_path):
    for how in ("SIGHUP", "stop.sh"):
        proc = subprocess.Popen(
            [PD / "run_prefill.sh", "--foreground"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            assert wait_for(lambda: listening(int(env["PD_PREFILL_PORT"])), timeout=60), "the stub never listened"
            server = record(tmp_path)  # the foreground writes a pid record too
            assert server["supervisor"] == proc.pid and alive(server["pid"])
            child = int((tmp_path / "child.pid").read_text())
            if how == "SIGHUP":
                proc.send_signal(signal.SIGHUP)  # what a dropped SSH session sends
            else:
                stopped = launch(PD / "stop.sh", env=env)
                assert stopped.returncode == 0 and "prefill: stopped" in stopped.stderr, stopped.stderr
            proc.wait(timeout=60)
        finally:
            proc.kill()
            proc.wait()
        pids = (server["pid"], child)
        assert wait_for(lambda pids=pids: not any(map(alive, pids))), how
        assert not (tmp_path / "logs" / "prefill.pid").exists(), how


# ---------------------------------------------------------------------------------- one host


def test_one_host_refuses_overlapping_gpus_and_up_places_the_decode_after_the_prefill(env, tmp_path):
    tp = {"PD_PREFILL_TP": "2", "PD_PREFILL_CP": "2", "PD_DECODE_TP": "2", "PD_DECODE_DP": "2"}
    overlap = launch(PD / "up.sh", env={**env, **tp, "PD_DECODE_BASE_GPU_ID": "1"})
    assert overlap.returncode == 2, overlap.stderr
    assert "PD_PREFILL_BASE_GPU_ID=0, PD_PREFILL_TP=2: GPU 0,1" in overlap.stderr and "share GPU 1" in overlap.stderr
    assert not list((tmp_path / "logs").glob("*.pid"))

    up = launch(PD / "up.sh", env={**env, **tp})
    assert up.returncode == 0, up.stderr
    assert (record(tmp_path, "prefill")["gpus"], record(tmp_path, "decode")["gpus"]) == (["0", "1"], ["2", "3"])
    # A second decode by hand on the prefill's GPUs is refused while the prefill runs.
    assert launch(PD / "stop.sh", "decode", env=env).returncode == 0
    clash = launch(PD / "run_decode.sh", env={**env, **tp, "PD_DECODE_BASE_GPU_ID": "0"})
    assert clash.returncode == 2 and "but the prefill already runs on GPU 0,1 of this host" in clash.stderr


def test_up_with_the_sizes_unset_fits_one_8_gpu_host(env, tmp_path):
    """The one-host recipe as docs/operations.md runs it (no TP set): prefill TP4/CP4 on GPUs 0-3, decode TP4/DP4 on 4-7
    (the defaults of one 8-GPU node per server would put the decode on GPUs 8-15), said on stderr."""
    env = {k: v for k, v in env.items() if k not in ("PD_PREFILL_TP", "PD_PREFILL_CP", "PD_DECODE_TP", "PD_DECODE_DP")}
    up = launch(PD / "up.sh", env=env)
    assert up.returncode == 0, up.stderr
    assert "one host: PD_PREFILL_TP=4, PD_PREFILL_CP=4, PD_DECODE_TP=4, PD_DECODE_DP=4 (unset)" in up.stderr
    gpus = (record(tmp_path, "prefill")["gpus"], record(tmp_path, "decode")["gpus"])
    assert gpus == (["0", "1", "2", "3"], ["4", "5", "6", "7"])
    assert launch(PD / "stop.sh", env=env).returncode == 0


def test_a_second_up_refuses_and_leaves_the_running_roles_running(env, tmp_path):
    """Issue 54: a second ``up`` while all three roles ran refused ("prefill already runs") and then stopped all
    three. It refuses before it starts anything, and stops nothing it did not start."""
    up = launch(PD / "up.sh", env=env)
    assert up.returncode == 0, up.stderr
    records = {role: record(tmp_path, role) for role in ("prefill", "decode", "router")}
    again = launch(PD / "up.sh", env=env)
    assert again.returncode == 2 and "prefill already runs" in again.stderr, again.stderr
    assert ": stopped" not in again.stderr and "started " not in again.stderr
    assert {role: record(tmp_path, role) for role in records} == records
    assert all(alive(rec["pid"]) for rec in records.values())
    assert launch(PD / "pd.sh", "status", env=env).returncode == 0
    assert launch(PD / "stop.sh", env=env).returncode == 0


def fake_nvidia_smi(tmp_path: Path, gpus: int) -> str:
    """A directory for PATH holding an ``nvidia-smi`` that lists ``gpus`` GPUs as ``nvidia-smi -L`` does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    lines = "".join(f"echo 'GPU {i}: NVIDIA B300 SXM6 AC (UUID: GPU-{i:08d})'\n" for i in range(gpus))
    smi.write_text(f'#!/bin/sh\n[ "$1" = -L ] || exit 9\n{lines}')
    smi.chmod(0o755)
    return str(bin_dir)


def test_up_refuses_gpus_this_host_lacks_before_starting_anything(env, tmp_path):
    """Issue 54: ``up`` with the documented B300 env file (prefill TP8/CP8, decode TP8/DP8) on an 8-GPU host started
    the decode on GPUs 8-15. Refused before anything starts, naming the variables; the GPUs are counted as the
    servers see them (CUDA_VISIBLE_DEVICES when set, else nvidia-smi's list)."""
    host = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
    host["PATH"] = fake_nvidia_smi(tmp_path, 8) + os.pathsep + env["PATH"]
    b300 = {
        **host,
        "PD_ENV_FILE": str(PD / "glm51-fp8-b300.env"),
        "PD_PREFILL_URL": f"http://127.0.0.1:{env['PD_PREFILL_PORT']}",
        "PD_DECODE_URL": f"http://127.0.0.1:{env['PD_DECODE_PORT']}",
    }
    up = launch(PD / "up.sh", env=b300)
    assert up.returncode == 2, up.stderr
    assert "PD_DECODE_BASE_GPU_ID=8 and PD_DECODE_TP=8 put the decode on GPU 8-15" in up.stderr, up.stderr
    assert "this host has 8 GPUs (0-7, nvidia-smi -L)" in up.stderr
    assert not list((tmp_path / "logs").glob("*.pid")) and "started " not in up.stderr
    # The documented one-host split on a host that shows 4 GPUs to the launchers.
    four = launch(PD / "up.sh", env={**host, "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert four.returncode == 2 and "put the decode on GPU 4-7" in four.stderr, four.stderr
    assert "this host has 4 GPUs (0-3, CUDA_VISIBLE_DEVICES=0,1,2,3)" in four.stderr
    # One role by hand past the host's GPUs.
    decode = launch(PD / "run_decode.sh", env={**host, "PD_DECODE_BASE_GPU_ID": "4"})
    assert decode.returncode == 2 and "PD_DECODE_BASE_GPU_ID=4 and PD_DECODE_TP=8" in decode.stderr, decode.stderr
    assert not list((tmp_path / "logs").glob("*.pid"))
    # Within the host: starts (the stubs need no GPU).
    fits = launch(PD / "run_decode.sh", env={**host, "PD_DECODE_TP": "8", "PD_DECODE_DP": "8"})
    assert fits.returncode == 0, fits.stderr


def test_a_misspelled_role_is_refused_by_name(env):
    for args in (["status", "prefil"], ["stop", "prefil"], ["wait", "prefil"]):
        ran = launch(PD / "pd.sh", *args, env=env)
        assert ran.returncode == 2 and "unknown role 'prefil'" in ran.stderr and "Traceback" not in ran.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
