"""A stand-in for ``PD_PYTHON``: run as ``pd_stub.py -m sglang.launch_server ARGS`` it acts as a P/D server.

The launcher tests point ``PD_PYTHON`` at a script that runs this file, so the real launchers start, supervise and
stop it as they would a server. It serves ``/health`` (200) on ``--host``/``--port`` and answers ``POST /generate``
and ``/v1/completions`` with a fixed completion, appending each request's JSON body to ``STUB_REQUESTS_FILE`` when
set; it spawns a child (pid in ``STUB_CHILD_PID_FILE``) so a test can see the whole group end, and prints its
``server_args`` with every secret in plain text, as upstream does. ``STUB_MODE``: ``serve`` (default), ``exit``
(exit 3), ``hang`` (never listen), ``ignore-term`` (serve, ignoring SIGTERM), ``flood`` (``STUB_FLOOD_BYTES`` of
output, then exit 0). Standard library only (it starts in a second on a loaded machine); the helpers below are the
tests' side.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def _value(argv: list[str], flag: str, default: str = "") -> str:
    return argv[argv.index(flag) + 1] if flag in argv else default


class _Handler(http.server.BaseHTTPRequestHandler):
    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path in ("/health", "/health_generate"):
            return self._answer(200, {})
        if self.path.startswith(("/server_info", "/get_server_info")):
            return self._answer(200, {"dp_size": 1})
        if self.path.startswith(("/model_info", "/get_model_info")):
            return self._answer(200, {"model_path": "stub", "is_generation": True})
        if self.path.startswith("/v1/models"):
            return self._answer(200, {"data": [{"id": "stub"}]})
        return self._answer(404, {})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        requests_file = os.environ.get("STUB_REQUESTS_FILE")
        if requests_file:
            with open(requests_file, "a") as f:
                f.write(json.dumps({"path": self.path, "body": json.loads(body or b"{}")}) + "\n")
        if self.path.startswith("/v1/completions"):  # OpenAI's shape (the contamination client's)
            return self._answer(
                200, {"object": "text_completion", "choices": [{"index": 0, "text": "stub", "finish_reason": "length"}]}
            )
        self._answer(200, {"text": "stub", "meta_info": {"finish_reason": {"type": "stop"}}})

    def log_message(self, *args):
        pass


def main(argv: list[str]) -> int:
    if argv[:1] == ["-m"]:
        argv = argv[2:]
    port = int(_value(argv, "--port", "0"))
    host = _value(argv, "--host", "127.0.0.1")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    if os.environ.get("STUB_CHILD_PID_FILE"):
        with open(os.environ["STUB_CHILD_PID_FILE"], "w") as f:
            f.write(str(child.pid))
    # What upstream prints at start-up: its arguments, secrets in plain text, and its environment's token.
    print(f"stub server starting on {host}:{port}", flush=True)
    print(f"server_args=ServerArgs(argv={argv!r}, hf_token={os.environ.get('HF_TOKEN')!r})", flush=True)
    mode = os.environ.get("STUB_MODE", "serve")
    if mode == "exit":
        return 3
    if mode == "hang":
        time.sleep(300)
        return 0
    if mode == "flood":
        line = b"x" * 1023 + b"\n"
        for _ in range(int(os.environ.get("STUB_FLOOD_BYTES", "4194304")) // len(line)):
            sys.stdout.buffer.write(line)
        sys.stdout.flush()
        return 0
    if mode == "ignore-term":  # a server that does not stop on SIGTERM (its child does)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    http.server.ThreadingHTTPServer((host, port), _Handler).serve_forever()
    return 0


# ------------------------------------------------------------------------------ the tests' side


def write_stub_python(directory: Path) -> Path:
    """An executable to use as PD_PYTHON: it runs this stub with the test's interpreter."""
    stub = directory / "stub_python"
    stub.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} "$@"\n')
    stub.chmod(0o755)
    return stub


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(predicate, timeout: float = 20.0) -> bool:
    """Poll ``predicate`` every 0.1 s until it holds or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.1)
    return predicate()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
