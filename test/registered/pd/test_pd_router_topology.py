"""Upstream's real router (sglang_router, requirements/dev-cpu.txt) between stub servers on two addresses.

127.0.0.2 stands for the prefill node and 127.0.0.3 for the decode node. The launchers start the stub
servers (sglang_cpkv.testing.pd_stub as PD_PYTHON) and the real router, set the way the documented
two-node recipe (docs/operations.md) sets them; one request through the router must reach the decode with the prefill
node's address as its ``bootstrap_host`` (where the decode fetches the KV from). The README's former
recipe, the router given only PD_DECODE_URL, made that the loopback (on node B: the decode itself); it
is refused now. With the prefill gone the router still answers its own ``/health`` with 200, so the
launchers' health of the router (the compose health check) checks its workers.
"""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.pd_stub import free_port, wait_for, write_stub_python

register_cpu_ci(est_time=20, suite="cpkv-cpu")

REPO = Path(__file__).resolve().parents[3]
PD = REPO / "scripts" / "pd"
NODE_A, NODE_B = "127.0.0.2", "127.0.0.3"  # loopback addresses: no setup on Linux, nothing leaves the host


@pytest.fixture
def nodes(tmp_path):
    prefill_port, decode_port = free_port(NODE_A), free_port(NODE_B)
    env = {
        **os.environ,
        "PD_LAUNCH_PYTHON": sys.executable,
        "PD_LOG_DIR": str(tmp_path / "logs"),
        "PD_PREFILL_HOST": NODE_A,
        "PD_PREFILL_PORT": str(prefill_port),
        "PD_BOOTSTRAP_PORT": str(free_port(NODE_A)),
        "PD_DECODE_HOST": NODE_B,
        "PD_DECODE_PORT": str(decode_port),
        "PD_DECODE_BASE_GPU_ID": "8",  # both "nodes" share this host's pid records
        "PD_ROUTER_HOST": "127.0.0.1",
        "PD_ROUTER_PORT": str(free_port()),
        # The documented two-node recipe: every URL each role needs.
        "PD_PREFILL_URL": f"http://{NODE_A}:{prefill_port}",
        "PD_DECODE_URL": f"http://{NODE_B}:{decode_port}",
        # The router polls new workers every 10 s by default; a test need not wait that long.
        "PD_ROUTER_EXTRA_ARGS": "--worker-startup-check-interval 1",
        "PD_HEALTH_TIMEOUT": "120",
        "PD_STOP_TIMEOUT": "10",
    }
    stub = str(write_stub_python(tmp_path))
    yield env, stub, tmp_path
    subprocess.run([PD / "stop.sh"], env=env, capture_output=True, timeout=120)


def launch(script, env, *args):
    return subprocess.run([PD / script, *args], env=env, capture_output=True, text=True, timeout=180)


def requests_seen(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_decode_gets_the_prefill_nodes_address_as_its_bootstrap_host(nodes):
    env, stub, tmp_path = nodes
    for role in ("prefill", "decode"):
        server_env = {**env, "PD_PYTHON": stub, "STUB_REQUESTS_FILE": str(tmp_path / f"{role}.requests")}
        started = launch(f"run_{role}.sh", server_env)
        assert started.returncode == 0, started.stderr
    started = launch("run_router.sh", {**env, "PD_PYTHON": sys.executable})  # the real sglang_router
    assert started.returncode == 0, started.stderr

    body = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 4}}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{env['PD_ROUTER_PORT']}/generate", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
    assert wait_for(
        lambda: requests_seen(tmp_path / "decode.requests") and requests_seen(tmp_path / "prefill.requests")
    )
    (to_decode,) = [r["body"] for r in requests_seen(tmp_path / "decode.requests") if r["path"] == "/generate"]
    (to_prefill,) = [r["body"] for r in requests_seen(tmp_path / "prefill.requests") if r["path"] == "/generate"]
    assert to_decode["bootstrap_host"] == NODE_A, to_decode
    assert to_decode["bootstrap_port"] == int(env["PD_BOOTSTRAP_PORT"])
    assert to_decode["bootstrap_room"] == to_prefill["bootstrap_room"]

    # A dead prefill: the router's own /health still says 200; the launchers' health of the router does not.
    assert launch("stop.sh", env, "prefill").returncode == 0
    with urllib.request.urlopen(f"http://127.0.0.1:{env['PD_ROUTER_PORT']}/health", timeout=30) as response:
        assert response.status == 200
    seen = launch("run_router.sh", env, "status")
    assert seen.returncode == 1 and f"its worker {env['PD_PREFILL_URL']}/health does not answer 200" in seen.stdout


def test_the_former_two_node_router_recipe_is_refused(nodes):
    env, _, _ = nodes
    former = {k: v for k, v in env.items() if k != "PD_PREFILL_URL"}  # only PD_DECODE_URL, as the README had it
    for args in (["--dry-run"], []):
        refused = launch("run_router.sh", {**former, "PD_PYTHON": sys.executable}, *args)
        assert refused.returncode == 2 and "PD_DECODE_URL is set but PD_PREFILL_URL is not" in refused.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
